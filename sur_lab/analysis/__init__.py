"""Analysis: answer scoring, endpoints, statistics and the shared figure helpers. It builds on the core API and never
imports a sweep or a study (the case runner that uses these functions is :mod:`sur_lab.sweeps.case`).
"""
