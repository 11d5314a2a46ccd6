"""The request path: what runs for every request between a door and the engines.

``descriptor`` (parse and validate a request's meta), ``messages`` (the
request and response objects), ``entries`` (a request once admitted),
``scheduler`` (admission, deadlines, delivery), ``latency`` (the batchers'
latency guard) and ``dispatch`` (the
dispatcher every door calls: route, validate, prepare, admit, settle).  Each
is one source with a compiled twin (``_<name>``, built from its ``.pxd`` or
``csrc/_descriptor.pyx``); ``lumen_core.native`` chooses the twins.
"""
