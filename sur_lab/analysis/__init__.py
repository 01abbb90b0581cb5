"""Analysis: answer scoring, endpoints, the evaluation of one case over methods, statistics and the shared figure
helpers. It builds on the core API and never imports a study.
"""
