"""``benchmarks/peers.py`` runs, and its parity check is what makes its comparison fair.

One spawned world of 2 ranks, the tiny Llama at tp 2 (+SP here) against ``transformers``' own tensor parallelism,
one warm-up and one timed step each: the per-step losses of the two sides agree (``LOSS_ATOL``). In the same
process group a third side, ``transformers`` loaded from weights of another seed (negative control), is flagged:
its losses do not agree with ours, so a benchmark row comparing different trainings cannot pass as a fair one.
"""
from __future__ import annotations

from benchmarks import peers


def test_peers_tp2_losses_agree_and_a_different_seed_is_flagged(tmp_path):
    spec = peers.pair_spec("llama", "tiny", "tp2", root=str(tmp_path), steps=1, rounds=1, warmup=1,
                           extra_peers=({"name": "transformers@seed1", "seed": 1},))
    rows = {row["peer"]: row for row in peers.run_pairs([spec], timeout=300)}
    fair, unfair = rows["transformers"], rows["transformers@seed1"]
    assert fair["losses_agree"], fair["max_loss_diff"]
    assert len(fair["ours"]["losses"]) == len(fair["theirs"]["losses"]) == 2  # warm-up + timed step, both compared
    assert not unfair["losses_agree"], unfair["max_loss_diff"]
    assert "MISMATCH" in peers.table([unfair]) and "MISMATCH" not in peers.table([fair])
    for side in (fair["ours"], fair["theirs"]):
        assert side["tokens_per_s"] > 0 and side["state_bytes"] > 0 and side["activation_bytes"] > 0
