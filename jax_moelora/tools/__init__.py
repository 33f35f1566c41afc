"""The commands built on the library, apart from it.

Nothing in the library (``jax_moelora/*.py``, ``ops``, ``nnx``, ``peft``)
imports this subpackage; it imports the library like any user would.

- ``demo``: the end-to-end demo (``python -m jax_moelora demo``) and its
  decode and prefill timings (``demo --timing``);
- ``train``: fine-tuning two LoRA adapters at once (``python -m jax_moelora
  train``); ``transformers_peer``: the same layers in transformers + peft, its
  reference;
- ``bench`` with ``bench_cases``, ``bench_methods`` and ``bench_plot``: the
  benchmark of docs/semantics.md §7 (``python -m jax_moelora bench``);
  ``bench_gemm`` (``bench --gemm``): the grouped expert GEMM against
  ``lax.ragged_dot``; ``bench_train`` (``bench --train``): the training step;
- ``step_profile``: GPU kernel time per name from a profiler trace
  (``demo --timing --trace``, ``bench --trace``);
- ``scaling``: multi-device correctness and weak scaling of the sharded folds
  (``python -m jax_moelora.tools.scaling``); ``block_scaling`` (``scaling
  --block``): the MoE block on a mesh, weak and strong scaling, collective
  bytes, and the cost model of docs/scaling.md.

``demo``, ``train`` and ``bench`` need the ``nnx``, ``peft`` and ``bench``
extras (``pip install 'jax_moelora[all]'``).
"""
