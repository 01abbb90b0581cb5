"""Studies: one module (or subpackage) per notebook's experiment, built on the core API.

``quickstart`` (00), ``theory`` (01: the bound and the cost model), ``niah`` (02: Erasing-NIAH, allocation geometry),
``natural_qa`` (03: natural multi-hop QA, quality vs latency), ``bench`` (04: packed refresh benchmark), ``validation``
(05: kernel and executor numerics), ``noprefix`` (06: non-prefix reuse, SAFE-KV), ``staleness`` (where staleness
lives, used by 01), and ``datasets`` (the QA loaders they share). Nothing below this package imports it.
"""
