"""The idle split of a step's timeline: idle between device spans, and the part with nothing to train."""
from sfrrl_jax.trainer.timeline import Timeline, WaitingWork


def test_idle_split_counts_gaps_and_their_starved_part_exactly():
    tl = Timeline()
    # spans arrive in end-time order (device work is sequential): one that starts before the
    # window [0, 10], decode 1-2, decode 2-3 (touching), train 5-6, decode 5.5-7 (overlapping)
    for name, lane, a, b in [("decode", "engine", -1, 0.5), ("decode", "engine", 1, 2), ("decode", "engine", 2, 3),
                             ("grad_microstep", "train", 5, 6), ("decode", "engine", 5.5, 7)]:
        tl.add(name, lane, a, b)
    waiting = WaitingWork()
    waiting.update(0, 0.0)
    waiting.update(2, 4.0)   # a group finished at t=4 ...
    waiting.update(1, 4.5)   # (counts above zero only mark the interval)
    waiting.update(0, 5.0)   # ... and its micro-step starts at t=5
    waiting.update(1, 8.0)
    waiting.update(0, 9.0)
    split = tl.idle_split(0.0, 10.0, waiting.intervals)
    # gaps: 0.5-1, 3-5, 7-10 -> 0.5 + 2 + 3 = 5.5 idle; waiting covers 4-5 and 8-9 -> 2 s fillable
    assert split == {"idle_s": 5.5, "starved_s": 3.5}
    assert waiting.intervals == [(4.0, 5.0), (8.0, 9.0)]
    assert tl.idle_split(1.0, 3.0, waiting.intervals) == {"idle_s": 0.0, "starved_s": 0.0}
