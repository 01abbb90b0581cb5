"""The data layer: where the multi-hop QA files live, what they are called, how a user gets them, and how studies read
them.

- :mod:`sur_lab.data.layout`: the file layout every loader reads (dataset keys, the file of each split, the corpus,
  the held-out files, the ``SHA256SUMS`` format), shared by :mod:`sur_lab.data.qa` and the fetcher.
- :mod:`sur_lab.data.fetch`: ``sur-lab data status`` (what was found where, each file against its pinned checksum,
  which files are held out) and ``sur-lab data fetch`` (download the datasets' official releases, convert them to the
  layout, verify them into a cache folder).
- :mod:`sur_lab.data.qa`: :class:`~sur_lab.data.qa.QAExample` and the loaders (``load_qa``, ``load_example``,
  ``load_corpus``), checksum verification, the seeded source selection (``select_sources``).
- :mod:`sur_lab.data.text`: the text helpers studies share (eligibility, the per-source generator, block joining,
  sentence truncation).

It sits just above the core: it imports the core and nothing from ``analysis/``, ``sweeps/``, ``studies/`` or
``runtime/`` (``tests/test_layout.py``, statically and at run time).
"""
