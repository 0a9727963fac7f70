r"""A gallery of real port pairs: two independently written implementations, one from PyPI or torch, one from
diffusers, with a catalogue of bugs planted in the port or in its weight conversion.

``catalogue.CASES`` lists every case with its ground truth; ``run.run_case`` runs one through
:func:`paritykit.bisect` (and :func:`paritykit.infer_conversion_map` for conversion cases) and scores the
answer. ``tests/test_gallery.py`` asserts the culprits; ``benchmarks/diagnosis.py`` publishes the scores."""
