"""torch.distributed glue: the only code that runs checkpoint collectives.

``save_plan.py`` (what each rank sends, plan caching, chunk assignment) and ``save.py`` (the
distributed save phases over :mod:`deltackpt.saving`).
"""
