"""The ``deltackpt`` command line and the built-in demo, outside the library's core.

``main.py`` parses and dispatches; ``snapshots.py`` (ls, show, du), ``diff.py`` and ``upkeep.py``
(verify, gc) are the commands; ``demo.py`` is ``deltackpt demo``; ``format.py`` renders tables
with rich when it is installed (``pip install deltackpt[cli]``) and as plain text otherwise.
Nothing in the library imports this package.
"""
