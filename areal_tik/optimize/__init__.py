"""Search for faster unified kernels without changing a bit: records, evaluator, proposers.

- ``records``   the IR: typed JSON records in a run directory (locked, atomic, append-only log)
- ``binding``   frozen hashes of the evaluator and the root's sources
- ``ops``       the op interface; ``op_attention`` and ``op_linear`` implement it
- ``checks``    the gate: the op's contract suite and the anti-hacking checks
- ``timing``    paired timing (CUDA graphs and events on the GPU, wall clock on the CPU)
- ``evaluator`` audits a candidate: gate, paired timing, the promotion rule
- ``proposers`` the mechanical proposer (knob moves, successive halving)
- ``prompt``    the contrastive prompt and an optional OpenAI-compatible client
- ``cli``       ``areal-tik optimize init | propose | audit | promote | status | prompt``
"""
