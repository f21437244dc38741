"""The ``pdserve`` command: the command line (``cli``), and ``pdserve up|down`` (``launcher``,
``launcher_cli``, ``run_dir``, ``pass_through``).

It only starts things: a node's start-up lives in ``common/node``, the libraries in ``common/``
(engine, model, serving, KV transfer), and the role packages (``prefill_node``, ``decode_node``,
``proxy``) hold what is particular to each process. No library or role package imports it.
"""
