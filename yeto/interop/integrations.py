"""DiLoCo for training scripts you already have, in a few lines.

A torch loop (any model whose trainable parameters are what you fine-tune: a
peft LoRA model, or a whole model)::

    from yeto.interop.integrations import DiLoCo

    diloco = DiLoCo(model, syncer="10.0.0.5:29400", learner_id="island-0", sync_every=50)
    for batch in loader:
        loss = model(**batch).loss
        loss.backward(); opt.step(); opt.zero_grad()
        if diloco.step(batch["labels"], loss=loss.item()):   # tokens counted from labels
            break                                            # the run is over
    diloco.finish()          # last push; the model then holds the final merged weights

A Hugging Face ``Trainer``::

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[DiLoCoCallback(syncer="10.0.0.5:29400", learner_id="island-0")])

An mlx-lm trainer (``mlx_lm.tuner.trainer.train``)::

    diloco = MLXDiLoCo(model, syncer="10.0.0.5:29400", learner_id="island-1",
                       base_model="path/to/hf-model")
    train(model, opt, train_set, val_set, args=targs, **diloco.trainer_kwargs(targs))
    diloco.finish()

How each one sees an optimizer step, and counts its loss tokens:

- `DiLoCo.step` is called by you once per optimizer step; give it the number of
  loss tokens, or the batch's labels (tokens whose shifted label is not -100 are
  counted, as a causal LM's loss does).
- `DiLoCoCallback`: ``on_train_begin`` joins the run (the model's trainable
  weights become the run's Θ); a forward hook on the model counts the loss
  tokens of every training forward pass (``labels != -100`` after the shift), so
  gradient accumulation is covered, and keeps each pass's loss; ``on_step_end``
  (once per optimizer step) applies arrived weights and pushes when due, with
  the step's tokens and mean loss (the Trainer's optimizer carries the guard, so a
  push is staged in the background while the next step's passes run);
  ``on_evaluate`` keeps the latest held-out loss; ``on_train_end`` finishes. When
  the syncer ends the run early, the callback sets ``control.should_training_stop``.
- `MLXDiLoCo`: mlx-lm 0.32's ``TrainingCallback`` has no per-step hook (only
  ``on_train_loss_report`` every ``steps_per_report`` steps and
  ``on_val_loss_report``), so the step hook is a wrapper of ``iterate_batches``:
  the trainer asks for batch *i+1* only after step *i* is done, which is the step
  boundary; the loss tokens come from each batch's lengths (what mlx-lm's
  ``default_loss`` counts). The callback it passes keeps the reported training
  and validation loss. mlx-lm's ``lora_a`` (in, r) / ``lora_b`` (r, out) are
  synced under peft's names and shapes (transposed), so torch and MLX islands of
  the same model, rank and scale join one run, and the syncer writes a peft adapter.

Importing this module imports neither torch, transformers nor mlx.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from yeto.island import Island, Weights
from yeto.loop import IslandDriver
from yeto.transport import Transport

log = logging.getLogger("yeto.interop.integrations")

IGNORE_INDEX = -100


def count_loss_tokens(labels, ignore_index: int = IGNORE_INDEX, shifted: bool = False) -> int:
    """Loss tokens of a batch's labels: those not ``ignore_index`` after the causal
    shift (``labels[..., 1:]``) unless ``shifted``. Takes a torch tensor, a numpy
    array or nested lists."""
    if hasattr(labels, "detach"):
        labels = labels.detach().cpu().numpy()
    a = np.asarray(labels)
    if not shifted and a.ndim >= 1 and a.shape[-1] > 0:
        a = a[..., 1:]
    return int(np.count_nonzero(a != ignore_index))


class _Base:
    """What the torch and MLX helpers share: the island's `yeto.loop.IslandDriver` over
    the model's weights, driven one optimizer step at a time by the caller's loop."""

    backend = "numpy"

    def _setup(self, weights: Weights, weights_file: str, files: dict[str, str],
               syncer: str | None, *, learner_id: str = "island-0", sync_every: int = 50,
               sync_every_seconds: float = 0.0, wire: str = "q4", token: str | None = None,
               tls=None, eval_fn=None, blocking: bool = False,
               output_dir: str | Path | None = None, report_to=None, start: bool = True,
               guard=None, **island_options):
        """The options both helpers take (documented on `DiLoCo`), in one place."""
        from yeto.client import connect

        self.learner_id = learner_id
        self.layout = weights.layout
        client = connect(syncer, learner_id, weights.layout, token=token, backend=self.backend,
                         weights_file=weights_file, export_files=files, tls=tls,
                         sync_every=0 if sync_every_seconds > 0 else sync_every)
        self.eval_fn = eval_fn
        self.driver = IslandDriver(weights, client, out=output_dir, report_to=report_to or (),
                                   on_sync=eval_fn, guard=guard, sync_every=sync_every,
                                   sync_every_seconds=sync_every_seconds, wire=wire,
                                   blocking=blocking, **island_options)
        self.output_dir = self.driver.out
        self.started = self.finished = False
        self.eval_before = float("nan")
        if start:
            self.start()

    @property
    def island(self) -> Island:
        """The island (`yeto.island.Island`) over the model's trainable weights."""
        return self.driver.island

    @property
    def client(self) -> Transport | None:
        """The connection to the syncer (None: training alone)."""
        return self.driver.client

    def start(self) -> None:
        """Join the run and load its Θ into the model (waits for the quorum)."""
        if self.started:
            return
        self.driver.start()
        self.started = True
        self.eval_before = float(self.eval_fn()) if self.eval_fn is not None else float("nan")
        self.driver.begin(eval_loss=self.eval_before)

    def step(self, loss_tokens, loss: float | None = None) -> bool:
        """Once per optimizer step. ``loss_tokens``: an int, or the batch's labels.
        Returns True when the run is over (the final weights are loaded: stop)."""
        if not self.started:
            self.start()
        if not isinstance(loss_tokens, (int, np.integer)):
            loss_tokens = count_loss_tokens(loss_tokens)
        if loss is not None and hasattr(loss, "item"):
            loss = loss.item()
        return self.driver.step(int(loss_tokens), loss)

    def finish(self) -> bool:
        """Last push, then the final Θ (the model then holds the syncer's final
        weights exactly). Returns True when the final weights arrived."""
        if self.finished:
            return self.island.finished
        self.finished = True
        got = self.driver.finish() if self.started else False
        self.driver.write(self.driver.summary(self.eval_before, self.island.eval_loss))
        self.driver.close()
        return got

    @property
    def version(self) -> int:
        """Version of the merged weights the model builds on (-1 before joining)."""
        return self.driver.version

    def __enter__(self):
        if not self.started:
            self.start()
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.finish()
        else:  # an error or Ctrl-C: leave the run without waiting for it to end
            self.driver.leave()
        return False


# ---- torch ---------------------------------------------------------------------------
class DiLoCo(_Base):
    """DiLoCo for a torch training loop: syncs the model's trainable parameters.

    ``syncer``: "host:port" (None trains alone); ``sync_every``: push every H
    optimizer steps (or ``sync_every_seconds``); ``eval_fn``: a callable returning
    a held-out loss, called before each push (it goes into the syncer's tape);
    ``output_dir``: where ``metrics.jsonl`` is written (``report_to="tensorboard"``
    adds TensorBoard scalars); ``optimizer``: the loop's torch optimizer, given so
    that a push is staged on a background thread while the next forward and backward
    run (a step pre-hook waits for it before the weights change; without it the
    push is staged in the loop, which is just as exact); other keyword arguments go
    to `yeto.island.Island`
    (``merge_alpha``, ``pipeline``, ``start_timeout_s``, ...). Starts (joins the
    run, loads Θ) at once unless ``start=False``. A peft model is synced under
    peft's saved names, so the syncer's ``final/`` loads with
    ``peft.PeftModel.from_pretrained``.
    """

    backend = "torch"

    def __init__(self, model, syncer: str | None, *, tuning: str | None = None,
                 optimizer=None, **options):
        from yeto.torch.learner import guard_optimizer
        from yeto.torch.weights import TorchWeights

        self.model = model
        self.tuning = tuning or ("lora" if _is_peft(model) else "full")
        self.weights = TorchWeights(model, self.tuning)
        if not self.weights.layout.specs:
            raise ValueError("the model has no trainable parameters (requires_grad=True): "
                             "attach LoRA first (e.g. peft.get_peft_model) or unfreeze weights")
        weights_file, files = _torch_export_files(model, self.tuning)
        guard = (lambda before_update: guard_optimizer(optimizer, before_update)) \
            if optimizer is not None else None
        self._setup(self.weights, weights_file, files, syncer, guard=guard, **options)


def _is_peft(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _torch_export_files(model, tuning: str) -> tuple[str, dict[str, str]]:
    if not hasattr(model, "save_pretrained"):
        return "weights.safetensors", {}
    from yeto.torch.model import export_files

    return export_files(model, tuning)


# ---- transformers.Trainer ------------------------------------------------------------
class _CallbackSteps:
    """A `transformers.TrainerCallback` that makes a Trainer a DiLoCo island.

    Takes `DiLoCo`'s keyword arguments (``syncer``, ``learner_id``,
    ``sync_every``, ``token``, ...); ``output_dir`` defaults to the Trainer's.
    A forward hook on the model sees every training forward pass: it counts the
    loss tokens (``labels != -100`` after the causal shift) and keeps the loss,
    so each optimizer step (all its gradient-accumulation micro-batches) is
    reported with its own tokens and mean loss; the latest evaluation loss goes
    into the pushes too.
    """

    def __init__(self, syncer: str | None, **kwargs: Any):
        self.syncer, self.kwargs = syncer, kwargs
        self.diloco: DiLoCo | None = None
        self._tokens = 0
        self._losses: list = []
        self._hook = None

    def on_train_begin(self, args, state, control, model=None, **kw):
        if self.diloco is not None:
            return
        kwargs = dict(self.kwargs)
        kwargs.setdefault("output_dir", getattr(args, "output_dir", None))
        opt = kw.get("optimizer")  # accelerate's wrapper steps the optimizer it holds
        kwargs.setdefault("optimizer", getattr(opt, "optimizer", opt))
        self.diloco = DiLoCo(model, self.syncer, **kwargs)
        self._hook = model.register_forward_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs, output):
        import torch

        if not module.training or not torch.is_grad_enabled():
            return
        labels = kwargs.get("labels")
        if labels is not None:
            n = count_loss_tokens(labels)
        else:
            ids = kwargs.get("input_ids", args[0] if args else None)
            mask = kwargs.get("attention_mask")
            n = int(mask[..., 1:].sum()) if mask is not None else (
                int(ids[..., 1:].numel()) if ids is not None else 0)
        self._tokens += n
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, dict):
            loss = output.get("loss")
        if loss is not None:
            # with num_items_in_batch the model divides by the whole step's tokens:
            # the step's loss is the sum of its passes; otherwise each pass is a mean
            whole_step = kwargs.get("num_items_in_batch") is not None
            self._losses.append((loss.detach(), n, whole_step))

    def on_evaluate(self, args, state, control, metrics=None, **kw):
        if self.diloco is not None and metrics and "eval_loss" in metrics:
            self.diloco.island.eval_loss = float(metrics["eval_loss"])

    def on_step_end(self, args, state, control, **kw):
        if self.diloco is None:
            return
        tokens, self._tokens = self._tokens, 0
        losses, self._losses = self._losses, []
        loss = None
        if losses and all(w for _, _, w in losses):
            loss = float(sum(x.float() for x, _, _ in losses))
        elif losses:
            total = sum(n for _, n, _ in losses)
            loss = float(sum(x.float() * max(n, 1) for x, n, _ in losses)
                         / max(total, len(losses)))
        if self.diloco.step(tokens, loss=loss):
            log.info("the syncer ended the run: stopping training with its final weights")
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kw):
        if self.diloco is not None:
            self.diloco.finish()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def _make_callback_class():
    """`DiLoCoCallback`: the steps above on transformers' `TrainerCallback` (imported
    on first use: importing transformers is slow)."""
    from transformers import TrainerCallback

    return type("DiLoCoCallback", (_CallbackSteps, TrainerCallback),
                {"__doc__": _CallbackSteps.__doc__, "__module__": __name__})


# ---- mlx-lm --------------------------------------------------------------------------
def batch_loss_tokens(batch) -> int:
    """Loss tokens of one mlx-lm batch ``(tokens (B, T), lengths (B, 2))``: the
    target positions ``1..T-1`` from each row's offset to its length, as
    ``mlx_lm.tuner.trainer.default_loss`` masks them."""
    tokens, lengths = batch[0], np.asarray(batch[1])
    t = tokens.shape[1]
    lo = np.maximum(lengths[:, 0], 1)
    hi = np.minimum(lengths[:, 1], t - 1)
    return int(np.maximum(hi - lo + 1, 0).sum())


class MLXDiLoCo(_Base):
    """DiLoCo for mlx-lm's trainer (or your own MLX loop: call `step` per update).

    ``model``: an mlx-lm model with LoRA attached (``linear_to_lora_layers``).
    ``base_model``: the Hugging Face model dir, written into the peft adapter
    config the syncer saves (``final/adapter_config.json``). Other arguments as
    `DiLoCo`. ``tokens_fn(batch) -> int`` counts a batch's loss tokens (default:
    `batch_loss_tokens`, for mlx-lm's batches and ``default_loss``).
    """

    backend = "mlx"

    def __init__(self, model, syncer: str | None, *, base_model: str | Path | None = None,
                 tokens_fn=None, **options):
        self.model = model
        from yeto.mlx.lora import LoRAWeights

        self.weights = LoRAWeights(model)
        self.tokens_fn = tokens_fn or batch_loss_tokens
        files: dict[str, str] = {}
        weights_file = "weights.safetensors"
        lora = self.weights.lora_config()
        if lora is not None:
            from yeto.interop.adapters import PEFT_CONFIG, PEFT_WEIGHTS, peft_adapter_config

            r, scale, modules = lora
            weights_file = PEFT_WEIGHTS
            files = {PEFT_CONFIG: peft_adapter_config(str(base_model or ""), r, scale * r,
                                                      modules)}
        self._pending: list[int] = []   # loss tokens of micro-batches not yet stepped
        self._accum = 1
        self._loss: float | None = None
        self._stop = False
        self._in_flight: int | None = None  # tokens of the batch the trainer is stepping
        self._setup(self.weights, weights_file, files, syncer, **options)

    def trainer_kwargs(self, args=None, iterate_batches=None, training_callback=None) -> dict:
        """``iterate_batches`` and ``training_callback`` for ``mlx_lm.tuner.trainer.train``.
        ``args``: the trainer's TrainingArgs (for grad_accumulation_steps);
        ``iterate_batches`` / ``training_callback``: yours, wrapped."""
        from mlx_lm.tuner.callbacks import TrainingCallback
        from mlx_lm.tuner.trainer import iterate_batches as default_iterate

        self._accum = max(1, int(getattr(args, "grad_accumulation_steps", 1) or 1))
        inner = iterate_batches or default_iterate
        outer = self

        def wrapped(dataset, batch_size, max_seq_length, loop=False, seed=None,
                    comm_group=None):
            it = inner(dataset=dataset, batch_size=batch_size, max_seq_length=max_seq_length,
                       loop=loop, seed=seed, comm_group=comm_group)
            if not loop:  # evaluation batches: not training steps
                yield from it
                return
            for batch in it:
                # asked for the next batch: the previous one has been stepped
                if outer._in_flight is not None:
                    outer._micro_batch_done()
                if outer._stop:
                    return  # the run is over: ending the iterator ends training
                outer._in_flight = outer.tokens_fn(batch)
                yield batch

        class Callback(TrainingCallback):
            def on_train_loss_report(self, info):
                outer._loss = float(info.get("train_loss", float("nan")))
                if training_callback is not None:
                    training_callback.on_train_loss_report(info)

            def on_val_loss_report(self, info):
                outer.island.eval_loss = float(info.get("val_loss", float("nan")))
                if training_callback is not None:
                    training_callback.on_val_loss_report(info)

        return {"iterate_batches": wrapped, "training_callback": Callback()}

    def _micro_batch_done(self) -> None:
        self._pending.append(self._in_flight)
        self._in_flight = None
        if len(self._pending) >= self._accum:
            tokens = sum(self._pending)
            self._pending.clear()
            if self.step(tokens, loss=self._loss):
                self._stop = True

    def finish(self) -> bool:
        """Counts the trainer's last step (the trainer does not ask for a batch after
        it), then finishes as `DiLoCo.finish`."""
        if not self.finished and self._in_flight is not None:
            self._micro_batch_done()
        return super().finish()


def __getattr__(name: str):
    if name == "DiLoCoCallback":  # built on first use: importing transformers is slow
        cls = _make_callback_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# DiLoCoCallback is built on first access (module __getattr__)
__all__ = ["DiLoCo", "DiLoCoCallback", "MLXDiLoCo", "count_loss_tokens",  # noqa: F822
           "batch_loss_tokens"]
