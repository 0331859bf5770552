"""One-off verification (not in the suite): cp2 x 3D (q=2, tp8) and cp2 x 2.5D (q=2, d=2, tp8) = 16 ranks."""
from tests.parallel_layers import test_context_parallel_axes as t
from tests.helpers import decoders
from tests.helpers.dist import run_distributed
import oslo_models as om
import torch


def _w(path):
    for options in (dict(tensor_parallel_mode="3d", tensor_parallel_size=8),
                    dict(tensor_parallel_mode="2.5d", tensor_parallel_size=8, tensor_parallel_depth=2)):
        model = decoders.om_class("llama").from_pretrained(path, progress=False, parallel=om.ParallelConfig(
            context_parallel_size=2, **options)).train()
        ids, mask, labels = t.padded_batch(t.VOCAB, batch=8, seq=t.SEQ)
        t.train_matches(model, decoders.hf_class("llama").from_pretrained(path).train(),
                        dict(input_ids=ids, attention_mask=mask, labels=labels), steps=2)
        if torch.distributed.get_rank() == 0:
            print("OK", options, flush=True)


def test_16(tmp_path):
    run_distributed(_w, 16, decoders.save_tiny(tmp_path / "llama", "llama"), timeout=1500)
