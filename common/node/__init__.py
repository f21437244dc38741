"""A serving process's start-up, shared by every role: one node (``node``: engine + HTTP), a
daemon (``daemon``: node + KV endpoint + heartbeats), and the checks before anything loads and
the one-line failures (``startup``).

The role packages (``prefill_node``, ``decode_node``, ``proxy``) and the ``pdserve`` command
build on it; it imports none of them.
"""
