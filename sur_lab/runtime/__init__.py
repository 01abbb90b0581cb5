"""Runtime: the entry points, on top of every other layer: the ``sur-lab`` command (``cli``), the papermill notebook
runner (``run_notebooks``) and notebook parameter checks (``params``). Nothing imports this package except tests and
scripts.
"""
