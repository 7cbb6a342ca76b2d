"""cleave.generation: the text side of generation, shared by the engine and the gateway.

What a request asks for (`sampling_params`), what a sample produced and why it ended
(`outputs`), how token ids become text (`detokenizer`, `token_pieces`), where a sample stops
(`stop`), how thinking is split from the answer (`reasoning`) and the keys of seeded
sampling decisions (`seed_keys`). Nothing here imports torch or Triton, so a gateway that
only tokenizes and streams text starts without them; the engine's tensor code
(`cleave.engine`) builds on these types rather than keeping its own.
"""
