"""The guides' multi-process code blocks run as written, on the processes they are written for, and give what
single-process ``transformers`` gives: the README quickstart at tp 2 (its ``WORLD_SIZE`` sets tp), and every docs
block marked ``<!-- test: N -->`` on N processes (the pipeline guide's pp 2 x tp 2 step). Hub names (``"gpt2"``)
are replaced by a tiny GPT-2 saved locally; each rank checks the block's results against a ``transformers`` replay
of the same steps, so a guide that stops matching the library fails here."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.docs.test_code_blocks import ROOT, code_blocks
from tests.helpers.dist import run_distributed
from tests.helpers.models import save_tiny_gpt2

ATOL = 1e-5


def marked_blocks(world_size: int) -> list[tuple[str, str]]:
    return [(str(page.relative_to(ROOT)), code) for page in sorted((ROOT / "docs").rglob("*.md"))
            for code in code_blocks(page, "python", marked_only=True, world_size=world_size)]


def _exec_block(source: str, folder: str, workdir: str) -> dict:
    os.chdir(workdir)  # every rank in the same folder: the block's relative "out/" is one Hub folder
    namespace = {"__name__": "__docs_block__"}
    exec(compile(source.replace('"gpt2"', repr(folder)), "code block", "exec"), namespace)
    torch.distributed.barrier()  # rank 0's write of out/ is complete before any rank reads it
    return namespace


def _assert_same_weights(saved_folder: Path, reference) -> None:
    import transformers

    saved = transformers.GPT2LMHeadModel.from_pretrained(saved_folder).state_dict()
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(saved[name], tensor, atol=ATOL, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def _readme_quickstart(source: str, folder: str, workdir: str) -> None:
    import transformers

    ns = _exec_block(source, folder, workdir)
    assert ns["tp"] == 2 and ns["ctx"].tp_size == 2
    reference = transformers.GPT2LMHeadModel.from_pretrained(folder)  # the same mode (eval) the block trains in
    optimizer = torch.optim.AdamW(reference.parameters(), lr=3e-4)
    torch.manual_seed(0)
    ids = torch.randint(0, reference.config.vocab_size, (4, 64))
    for _ in range(3):
        loss = reference(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.testing.assert_close(ns["out"].loss, loss, atol=ATOL, rtol=0)
    _assert_same_weights(Path(workdir) / "out", reference)
    expected = reference.eval().generate(ids[:1, :8], max_new_tokens=20)
    assert torch.equal(ns["sample"].cpu(), expected), (ns["sample"], expected)


def _pipeline_guide(source: str, folder: str, workdir: str) -> None:
    import transformers

    ns = _exec_block(source, folder, workdir)
    assert ns["model"].parallel_context.pp_size == 2
    reference = transformers.GPT2LMHeadModel.from_pretrained(folder).train()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=3e-4)
    loss = reference(ns["ids"], labels=ns["ids"]).loss
    loss.backward()
    optimizer.step()
    torch.testing.assert_close(torch.as_tensor(ns["loss"]).float(), loss.detach(), atol=ATOL, rtol=0)
    with torch.no_grad():
        eval_loss = reference(ns["ids"], labels=ns["ids"]).loss
    torch.testing.assert_close(torch.as_tensor(ns["eval_loss"]).float(), eval_loss, atol=ATOL, rtol=0)
    _assert_same_weights(Path(workdir) / "out", reference)


def test_readme_quickstart_at_tp2_matches_transformers(tmp_path):
    (source,) = code_blocks(ROOT / "README.md", "python", marked_only=False)
    folder = save_tiny_gpt2(tmp_path / "gpt2")
    run_distributed(_readme_quickstart, 2, source, folder, str(tmp_path))


@pytest.mark.parametrize("page, code", marked_blocks(4), ids=lambda value: value if value.endswith(".md") else "")
def test_four_process_guide_blocks_match_transformers(page, code, tmp_path):
    assert page == "docs/pipeline-parallel.md", f"{page}: a new 4-process block needs its transformers replay here"
    folder = save_tiny_gpt2(tmp_path / "gpt2", n_positions=128)
    run_distributed(_pipeline_guide, 4, code, folder, str(tmp_path))


def test_the_marked_blocks_are_found():
    assert [page for page, _ in marked_blocks(4)] == ["docs/pipeline-parallel.md"]
