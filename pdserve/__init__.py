"""The processes' start-up and the ``pdserve`` command: what runs a node (``node``, ``daemon``),
the command line (``cli``), and ``pdserve up|down`` (``launcher``, ``launcher_cli``, ``run_dir``).

The libraries it wires together live in ``common/`` (engine, model, serving, KV transfer), which
imports nothing from here; the role packages (``prefill_node``, ``decode_node``, ``proxy``) hold
what is particular to each process.
"""
