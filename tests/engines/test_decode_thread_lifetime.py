"""The transformers engine's decode thread ends with its last engine (engine_hf.decoder_thread):
while it lives, its OpenMP team counts against the cores and libgomp throttles the spinning of
every other thread's team in the process, so a trainer's step (or the next test) beside an
idle engine's thread ran 1.5-1.9x as long (docs/results "An idle engine's thread slowed the rest
of its process")."""
from __future__ import annotations

import threading

from collab_app.engines.engine_types import Request, Sampling

GREEDY = Sampling(max_new_tokens=4, temperature=0.0)


def _thread(ident: int) -> threading.Thread:
    return next(t for t in threading.enumerate() if t.ident == ident)


def test_the_decode_thread_ends_with_its_last_engine_and_a_new_engine_starts_another(tiny_model_path):
    from collab_app.engines.engine_hf import TransformersEngine

    a = TransformersEngine(tiny_model_path, seed=0, decode_thread=True, quantize=None)
    b = TransformersEngine(tiny_model_path, seed=0, decode_thread=True, quantize=None)
    assert a._decoder is b._decoder and a._decoder.users == 2
    b.register_agent("base")
    old, first = a._decoder, _thread(a._decoder.ident)
    want = b.generate([Request("base", "Hello")], 1, GREEDY)[0][0].token_ids

    a.close()                        # b still decodes on it
    assert first.is_alive()
    assert b.generate([Request("base", "Hello")], 1, GREEDY)[0][0].token_ids == want
    b.close()
    b.close()                        # a second close changes nothing
    first.join(30)
    assert not first.is_alive(), "the decode thread outlived its last engine"

    c = TransformersEngine(tiny_model_path, seed=0, decode_thread=True, quantize=None)
    try:
        c.register_agent("base")
        assert c._decoder is not old and _thread(c._decoder.ident).is_alive()   # (an ident may be reused)
        assert c.generate([Request("base", "Hello")], 1, GREEDY)[0][0].token_ids == want
    finally:
        c.close()
