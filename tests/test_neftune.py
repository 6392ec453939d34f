"""NEFTune callback: noise formula and bound, train-only, hook lifecycle, padding mask, resumable draws, CLI."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import helpers.modules
from helpers.cli import cli_with_callback
from helpers.modules import TinyHF
from lit_trainer.callbacks.neftune import NEFTune, draw_seed, find_input_embedding

VOCAB, DIM, LEN = 16, 16, 8


class TinyLM(helpers.modules.TinyLM):
    """The tests' next-token model, recording the noise it sees, optionally failing at one step."""

    def __init__(self, fail_at_step: int | None = None) -> None:
        super().__init__(vocab=VOCAB, dim=DIM, lr=0.1, optimizer="sgd", record_noise=True)
        self.fail_at_step = fail_at_step

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.fail_at_step is not None and self.global_step == self.fail_at_step:
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


def _loader() -> DataLoader:
    return DataLoader(torch.randint(0, VOCAB, (16, LEN), generator=torch.Generator().manual_seed(0)), batch_size=4)


def _trainer(**kw) -> pl.Trainer:
    base = dict(
        accelerator="cpu",
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    return pl.Trainer(**{**base, **kw})


def _noise_of(model: nn.Module, ids: torch.Tensor, **kw) -> torch.Tensor:
    emb = model.get_input_embeddings()
    return emb(ids, **kw) - F.embedding(ids, emb.weight)


def test_noise_is_exact_reference_formula_and_within_bound() -> None:
    torch.manual_seed(0)
    model = TinyLM().train()
    cb = NEFTune(noise_alpha=5.0, seed=123)
    cb.attach(model)
    ids = torch.randint(0, VOCAB, (4, LEN))
    # bound m = alpha / sqrt(L * d) = 5 / sqrt(8 * 16) = 5 / sqrt(128) = 0.441942
    m = 5.0 / math.sqrt(LEN * DIM)
    assert m == pytest.approx(0.441942, abs=1e-6)  # tolerance: the constant is printed to 6 decimals
    first = _noise_of(model, ids)
    # exact: draw 0 on rank 0 is U(-m, m) from a generator seeded with draw_seed(123, 0, 0)
    gen = torch.Generator().manual_seed(draw_seed(123, 0, 0))
    expected = torch.empty(4, LEN, DIM).uniform_(-m, m, generator=gen)
    # tolerance: the noise is recovered as noisy - clean embeddings (values ~1), so float32 rounding of that
    # subtraction (<= 1.2e-7) remains; another seed or bound differs by ~m = 0.44
    torch.testing.assert_close(first, expected, atol=1e-6, rtol=0)
    draws = torch.stack([_noise_of(model, ids) for _ in range(200)])  # 200 * 4 * 8 * 16 = 102400 values
    assert draws.abs().max() <= m + 1e-6
    assert draws.abs().max() >= 0.999 * m  # P(all below) = 0.999**102400 ~ e**-102
    assert abs(draws.mean().item()) < 0.005  # sd of the mean = m / sqrt(3 * 102400) = 0.0008
    # variance of U(-m, m) is m**2 / 3 = 0.065104; the estimate's relative sd is ~0.3%
    assert draws.var().item() == pytest.approx(m * m / 3, rel=0.02)  # tolerance: ~6 sd of the estimate (0.3%)
    assert draws[0].ne(draws[1]).any()  # successive draws differ


def test_no_noise_in_eval_under_no_grad_or_after_detach() -> None:
    model = TinyLM()
    cb = NEFTune(noise_alpha=5.0, seed=1)
    cb.attach(model)
    ids = torch.randint(0, VOCAB, (2, LEN))
    model.eval()
    assert torch.equal(_noise_of(model, ids), torch.zeros(2, LEN, DIM))
    model.train()
    with torch.no_grad():  # e.g. rollouts generated in training mode
        assert torch.equal(_noise_of(model, ids), torch.zeros(2, LEN, DIM))
    assert _noise_of(model, ids).abs().max() > 0
    cb.detach()
    assert not model.embed._forward_hooks
    assert torch.equal(_noise_of(model, ids), torch.zeros(2, LEN, DIM))


def test_fit_noises_training_only_and_removes_hook() -> None:
    model = TinyLM()
    trainer = _trainer(val_check_interval=2, callbacks=[NEFTune(noise_alpha=5.0)])
    trainer.fit(model, _loader(), _loader())
    m = 5.0 / math.sqrt(LEN * DIM)
    assert len(model.seen["train"]) == 3 and all(0 < v <= m + 1e-6 for v in model.seen["train"])
    assert model.seen["val"] and all(v == 0.0 for v in model.seen["val"])  # in-training validation
    assert not model.embed._forward_hooks and not model.embed._forward_pre_hooks
    trainer.validate(model, _loader(), verbose=False)
    trainer.predict(model, _loader())
    assert model.seen["predict"] and all(v == 0.0 for v in model.seen["val"] + model.seen["predict"])


def test_hook_removed_when_fit_raises() -> None:
    model = TinyLM(fail_at_step=1)
    with pytest.raises(RuntimeError, match="boom"):
        _trainer(callbacks=[NEFTune(noise_alpha=5.0)]).fit(model, _loader())
    assert model.seen["train"] and model.seen["train"][0] > 0  # step 0 was noised
    assert not model.embed._forward_hooks


def test_state_dict_resumes_the_same_noise_sequence() -> None:
    torch.manual_seed(7)
    model = TinyLM().train()
    ids = torch.randint(0, VOCAB, (2, LEN))
    cb = NEFTune(noise_alpha=3.0)  # seed=None -> torch.initial_seed() == 7
    cb.attach(model)
    for _ in range(3):
        _noise_of(model, ids)
    state = cb.state_dict()
    assert state["seed"] == 7 and state["draws"] == 3
    assert all(isinstance(v, (int, float)) for v in state.values())  # primitives only
    expected = [_noise_of(model, ids) for _ in range(2)]
    cb.detach()
    torch.manual_seed(999)  # a different global seed must not matter after load_state_dict
    resumed = NEFTune(noise_alpha=3.0)
    resumed.load_state_dict(state)
    resumed.attach(model)
    for want in expected:
        assert torch.equal(_noise_of(model, ids), want)
    # another rank draws different noise from the same state
    resumed.attach(model, rank=1)
    resumed.load_state_dict(state)
    assert not torch.equal(_noise_of(model, ids), expected[0])


def test_fit_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path) -> None:
    # every batch is the same 4 sequences, so the data position after a resume cannot matter: only NEFTune's draws
    same_batches = torch.randint(0, VOCAB, (4, LEN), generator=torch.Generator().manual_seed(0)).repeat(4, 1)

    def run(max_steps: int, model: TinyLM, ckpt_path=None) -> pl.Trainer:
        trainer = _trainer(max_steps=max_steps, callbacks=[NEFTune(noise_alpha=5.0, seed=3)], default_root_dir=tmp_path)
        trainer.fit(model, DataLoader(same_batches, batch_size=4), ckpt_path=ckpt_path)
        return trainer

    torch.manual_seed(0)
    straight = TinyLM()
    init = {k: v.clone() for k, v in straight.state_dict().items()}
    run(8, straight)
    first_half = TinyLM()
    first_half.load_state_dict(init)
    run(4, first_half).save_checkpoint(tmp_path / "half.ckpt")
    state = torch.load(tmp_path / "half.ckpt", weights_only=True)["callbacks"]["NEFTune{'embedding_path': None}"]
    assert state == {"seed": 3, "draws": 8, "noise_alpha": 5.0}  # 2 embedding calls per step (recorder + loss)
    resumed = TinyLM()
    run(8, resumed, ckpt_path=tmp_path / "half.ckpt")
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters()))
    assert resumed.seen["train"] == straight.seen["train"][4:]


def _record_embedding_outputs(embedding: nn.Module) -> list[torch.Tensor]:
    outputs: list[torch.Tensor] = []
    embedding.register_forward_hook(lambda mod, args, out: outputs.append(out - F.embedding(args[0], mod.weight)))
    return outputs


def test_mask_padding_uses_forward_attention_mask_of_wrapped_hf_model() -> None:
    module = TinyHF().train()
    assert find_input_embedding(module) is module.model.model.embed_tokens
    cb = NEFTune(noise_alpha=5.0, mask_padding=True, seed=0)
    cb.attach(module)
    noise = _record_embedding_outputs(module.model.get_input_embeddings())  # runs after the NEFTune hook
    ids = torch.randint(3, 259, (2, 8))
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0], [1] * 8])
    for i in range(100):
        if i % 2:
            module.model(ids, attention_mask=mask)
        else:
            module.model(ids, mask)  # positional attention_mask is captured too
    stacked = torch.stack(noise)  # [100, 2, 8, 32]
    # row 0: L_0 = 5 real tokens, bound 5 / sqrt(5 * 32) = 0.395285; row 1: L_1 = 8, bound 5 / sqrt(256) = 0.3125
    b0, b1 = 5 / math.sqrt(5 * 32), 5 / math.sqrt(8 * 32)
    assert b0 == pytest.approx(0.395285, abs=1e-6) and b1 == 0.3125  # tolerance: printed to 6 decimals
    assert torch.equal(stacked[:, 0, 5:], torch.zeros_like(stacked[:, 0, 5:]))  # padding untouched
    assert b0 * 0.99 <= stacked[:, 0, :5].abs().max() <= b0 + 1e-6
    assert b1 * 0.99 <= stacked[:, 1].abs().max() <= b1 + 1e-6
    assert not cb._masks.stack  # every forward popped what it pushed
    cb.detach()
    assert not any(
        m._forward_pre_hooks or m._forward_hooks
        for m in module.model.modules()
        if m is not module.model.get_input_embeddings()
    )


class BatchMaskLM(TinyLM):
    """Calls the embedding directly (no forward with attention_mask): the batch's mask is the fallback."""

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        noise = self.embed(ids) - F.embedding(ids, self.embed.weight)
        self.seen["train"].append(noise.abs().masked_fill(mask[..., None].bool(), 0).max().item())  # on padding
        self.seen["val"].append(noise.abs().max().item())
        return self.head(self.embed(ids)).logsumexp(-1).mean()


def test_mask_padding_falls_back_to_batch_mask_and_errors_clearly() -> None:
    ids = torch.randint(0, VOCAB, (8, LEN))
    mask = torch.ones(8, LEN, dtype=torch.long)
    mask[:, 6:] = 0
    data = [{"input_ids": ids[i], "attention_mask": mask[i]} for i in range(8)]
    model = BatchMaskLM()
    _trainer(callbacks=[NEFTune(noise_alpha=5.0, mask_padding=True)]).fit(model, DataLoader(data, batch_size=4))
    assert model.seen["train"] == [0.0, 0.0, 0.0]  # nothing on padding
    assert all(0 < v <= 5 / math.sqrt(6 * DIM) + 1e-6 for v in model.seen["val"])  # L = 6 real tokens
    lone = TinyLM().train()
    cb = NEFTune(noise_alpha=5.0, mask_padding=True)
    cb.attach(lone)
    with pytest.raises(ValueError, match="found no attention_mask"):
        lone.embed(ids)
    with pytest.raises(ValueError, match=r"shape \(8, 4\) does not match"):
        lone(ids, attention_mask=mask[:, :4])


def test_embedding_lookup_path_and_errors() -> None:
    class Plain(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, DIM))

    plain = Plain()
    assert find_input_embedding(plain, "backbone.0") is plain.backbone[0]
    with pytest.raises(AttributeError, match="could not find the input embedding of Plain"):
        NEFTune(noise_alpha=1.0).attach(plain)
    with pytest.raises(AttributeError, match="Sequential has no attribute 'embed'"):
        find_input_embedding(plain, "backbone.embed")
    cb = NEFTune(noise_alpha=1.0, embedding_path="backbone.0")
    cb.attach(plain)
    assert cb.is_attached and len(plain.backbone[0]._forward_hooks) == 1
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="noise_alpha must be a number > 0"):
            NEFTune(noise_alpha=bad)


def test_configurable_from_lightning_cli() -> None:
    cli = cli_with_callback(
        TinyLM,
        "lit_trainer.callbacks.neftune.NEFTune",
        {"noise_alpha": 7.5, "mask_padding": True, "embedding_path": "embed"},
    )
    (cb,) = [c for c in cli.trainer.callbacks if isinstance(c, NEFTune)]
    assert (cb.noise_alpha, cb.mask_padding, cb.embedding_path, cb.seed) == (7.5, True, "embed", None)


class TwoEmbeddings(TinyLM):
    """Token and position-like embeddings: one NEFTune callback on each."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Embedding(VOCAB, DIM)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.embed(input_ids) + self.extra(input_ids))


def test_two_neftune_callbacks_keep_their_own_checkpoint_state(tmp_path) -> None:
    def callbacks() -> list[NEFTune]:
        return [NEFTune(5.0, embedding_path="embed", seed=1), NEFTune(3.0, embedding_path="extra", seed=2)]

    first = callbacks()
    trainer = _trainer(max_steps=2, callbacks=first)
    trainer.fit(TwoEmbeddings(), _loader())
    trainer.save_checkpoint(tmp_path / "two.ckpt")
    states = torch.load(tmp_path / "two.ckpt", weights_only=True)["callbacks"]
    assert {k: v["seed"] for k, v in states.items() if k.startswith("NEFTune")} == {
        "NEFTune{'embedding_path': 'embed'}": 1,
        "NEFTune{'embedding_path': 'extra'}": 2,
    }
    resumed = list(reversed(callbacks()))
    for cb in resumed:
        cb.seed = None  # take the seed from the checkpoint
    _trainer(max_steps=2, callbacks=resumed).fit(TwoEmbeddings(), _loader(), ckpt_path=tmp_path / "two.ckpt")
    assert [(cb.embedding_path, cb.state_dict()["seed"], cb.state_dict()["draws"]) for cb in resumed] == [
        ("extra", 2, first[1].state_dict()["draws"]),
        ("embed", 1, first[0].state_dict()["draws"]),
    ]
