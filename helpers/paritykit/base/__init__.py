r"""The base every room stands on: errors, files written safely, name maps, the report envelope, tensor files,
a call's inputs, and a user's SPEC.py loaded with every call into it guarded.

Modules: ``errors``, ``files``, ``naming``, ``report``, ``data`` (the shipped skills and templates), ``io``
(tensor and state-dict files), ``pickles`` (pickles read without running code from them), ``inputs`` (a call's
inputs), ``usercode``, ``lazy`` (lazy re-exports).
Nothing here imports torch at import time, and nothing here imports another room.
"""
