"""Runtime: resumable sweeps (``sweep``), the papermill notebook runner (``run_notebooks``) and path defaults
(``paths``). ``paths`` and ``sweep`` are infrastructure the studies use; the runner sits on top and reaches the studies
only through the notebooks.
"""
