"""Pipeline parallelism for this project's models, on ``torch.distributed.pipelining``.

    cfg = om.ParallelConfig(pipeline_parallel_size=2, num_microbatches=8, pipeline_schedule="1f1b")
    model = om.AutoModelForCausalLM.from_pretrained("gpt2", parallel=cfg)   # each stage loads only its layers
    loss = model.train_step({"input_ids": ids, "labels": ids}, optimizer=opt)  # loss on every rank
    model.save_pretrained("out/")                                           # one plain Hub folder

``adapter``: what a model family tells the engine; ``partition``: which layers each stage runs; ``stage``: cutting an unmodified model into stages; ``runner``:
torch's schedules over those stages (train/eval steps, gradient sync); ``plot``: the schedule as a picture;
``checkpoint``: per-stage loading and the all-stage save.
"""
from .adapter import PipelineAdapter, adapter_for
from .partition import measure_layer_costs, partition_by_cost, partition_layers
from .stage import PipelineLayout, StageLayers, StageModule


def __getattr__(name):
    # ``runner`` imports torch.distributed.pipelining, which imports torch._dynamo (~1 s): only on first use, so
    # that the models (whose adapters live in this package) and ``import oslo_models`` do not pay for it.
    if name in ("PipelineRunner", "schedule_class"):
        from . import runner

        return getattr(runner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["PipelineAdapter", "adapter_for", "PipelineRunner", "PipelineLayout", "StageLayers", "StageModule", "measure_layer_costs",
           "partition_by_cost", "partition_layers", "schedule_class"]
