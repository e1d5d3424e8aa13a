"""The emulated IPU device: the IPU process (its stream I/O, host memory and
zero-copy plans), the executable interpreter, and how a host starts one
(``launcher``, and the ``forkserver`` template it forks them from).

Nothing here is imported eagerly: the host imports ``launcher`` only, and
must not pay for onnxruntime.
"""
