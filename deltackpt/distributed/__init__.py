"""torch.distributed glue: the only code that runs checkpoint collectives.

``collectives.py`` (a process group or a world of one; failures carried as values),
``save_plan.py`` (what each rank sends, plan caching, chunk assignment, the manifest's inputs)
and ``save.py`` (THE save sequence, steps 1-6, for one process or N ranks).
"""
