"""The ``deltackpt`` command line (``main.py``) and the built-in demo (``demo.py``)."""
