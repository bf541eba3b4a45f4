"""The in-flight batcher's pieces; ``trtmoe.triton.batcher.InflightBatcher`` composes them.

* ``requests``  - what a caller submits and receives (``BatchRequest``, ``TokenEvent``, finish reasons)
* ``settings``  - ``BatcherSettings``, the batcher's options as one typed value
* ``state``     - ``BatchState``, the queues, lock and counters the pieces share
* ``delivery``  - ``TokenDelivery``: new tokens to callbacks (stream interval, stop sequences, failures)
* ``cancels``   - ``CancelWatch``: remembered cancels, the ``is_cancelled`` poller, dropping cancelled requests
* ``admission`` - ``Admission``: waiting requests into the batch (batched prefill within a time budget)
* ``loop``      - ``DecodeLoop``: the batcher thread (idle waits, memory trim, one iteration, shutdown)
"""
