"""Actors for trainer tests: each runs Megatron in its own process (torch.distributed and
Megatron's parallel state are per process)."""

from __future__ import annotations

import os

from engines.trainer.actor import TrainerActor
from relay import Actor, endpoint


def _megatron_tp1() -> None:
    """This process's gloo group and Megatron's parallel state at TP = 1 (once)."""
    import torch.distributed as dist

    from engines.trainer import cpu_shim

    cpu_shim.install()
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="env://")
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        model_parallel_cuda_manual_seed(1234)


class MegatronCheck(Actor):
    @endpoint
    def hf_roundtrip_and_logits(self, path: str, seq: int = 24) -> dict:
        import torch
        import transformers
        from safetensors.torch import load_file

        from engines.models.model import ModelConfig
        from engines.trainer.hybrid_layers import NOT_TRAINED
        from engines.trainer.megatron_model import (
            build_gpt,
            causal_mask,
            hf_to_megatron,
            megatron_to_hf,
        )

        _megatron_tp1()
        dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        cfg = ModelConfig.from_dir(path)
        hf_sd = load_file(os.path.join(path, "model.safetensors"))
        gpt = build_gpt(cfg).eval().to(dev)
        missing, unexpected = gpt.load_state_dict(
            {k: v.to(dev) for k, v in hf_to_megatron(cfg, hf_sd).items()}, strict=False
        )
        back = megatron_to_hf(cfg, {k: v.cpu() for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")})
        skip = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
        skip |= {k for k in hf_sd if k.startswith(NOT_TRAINED)}  # a vision tower, an MTP head
        exact = sorted(back) == sorted(set(hf_sd) - skip) and all(torch.equal(back[k], hf_sd[k]) for k in back)
        vl = cfg.text_prefix != "model."  # a VL checkpoint (Qwen3.5 ships as one)
        auto = transformers.AutoModelForImageTextToText if vl else transformers.AutoModelForCausalLM
        hf = auto.from_pretrained(path).eval().to(dev)
        torch.manual_seed(0)
        ids = torch.randint(5, 100, (2, seq)).to(dev)
        with torch.no_grad():
            ml = gpt(ids, torch.arange(seq, device=dev)[None].expand(2, -1), causal_mask(seq).to(dev))
            hl = hf(ids).logits
        return {
            "missing": [m for m in missing if not m.endswith("_extra_state")],
            "unexpected": list(unexpected),
            "exact": exact,
            "max_diff": float((ml - hl).abs().max()),
        }


    @endpoint
    def fused_ops_parity(self, path: str, seq: int = 24) -> dict:
        """Whether the model with the fused ops (engines/trainer/fusions.py) gives the logits
        and every gradient of megatron-core's unfused model (``RELAY_TRAINER_FUSIONS=0``) bit
        for bit, padded and packed (where no kernel runs: CPU)."""
        import torch
        from safetensors.torch import load_file

        from engines.models.model import ModelConfig
        from engines.trainer.batching import packed_inputs
        from engines.trainer.megatron_model import build_gpt, causal_mask, hf_to_megatron

        _megatron_tp1()
        cfg = ModelConfig.from_dir(path)
        weights = hf_to_megatron(cfg, load_file(os.path.join(path, "model.safetensors")))
        torch.manual_seed(0)
        ids = torch.randint(5, 100, (2, seq))
        rows = [[int(t) for t in ids[0, : seq // 3]], [int(t) for t in ids[1]]]
        out = []
        for fused in ("1", "0"):
            os.environ["RELAY_TRAINER_FUSIONS"] = fused
            try:
                gpt = build_gpt(cfg)
            finally:
                os.environ.pop("RELAY_TRAINER_FUSIONS")
            gpt.load_state_dict(weights, strict=False)
            logits = gpt(ids, torch.arange(seq)[None].expand(2, -1), causal_mask(seq))
            pids, pos, _, params, _ = packed_inputs(rows, torch.device("cpu"))
            packed = gpt(pids, pos, None, packed_seq_params=params)
            (logits.square().mean() + packed.square().mean()).backward()
            out.append((logits.detach(), packed.detach(),
                        {n: p.grad.clone() for n, p in gpt.named_parameters() if p.grad is not None}))
        (la, pa, ga), (lb, pb, gb) = out
        return {"logits": torch.equal(la, lb), "packed": torch.equal(pa, pb), "grads": sorted(ga) == sorted(gb),
                "unequal_grads": [n for n in ga if n in gb and not torch.equal(ga[n], gb[n])]}


class LongContextCheck(Actor):
    """Fused attention and chunked log-probs against Megatron's own attention and whole logits."""

    @endpoint
    def parity(self, path: str, rows: int = 3, seq: int = 40, recompute: dict | None = None) -> dict:
        """Max abs differences (fp32) of log-probs, entropies and every gradient between
        ``attention="local"`` with whole logits and ``"sdpa"`` with logits in chunks of 5 (and
        ``recompute``: Megatron's activation recompute settings)."""
        import torch
        from safetensors.torch import load_file

        from engines.kernels import token_logprobs as token_kernels
        from engines.models.model import ModelConfig
        from engines.trainer.megatron_model import build_gpt, causal_mask, hf_to_megatron, token_logprobs

        _megatron_tp1()
        cfg = ModelConfig.from_dir(path)
        sd = hf_to_megatron(cfg, load_file(os.path.join(path, "model.safetensors")))
        torch.manual_seed(0)
        ids = torch.randint(5, 100, (rows, seq + 1))
        pos = torch.arange(seq)[None].expand(rows, -1)
        out = []
        for attention, chunk, again in (("local", 10**9, None), ("sdpa", 5, recompute)):
            gpt = build_gpt(cfg, attention=attention, recompute=again)
            gpt.load_state_dict(sd, strict=False)
            gpt.train()
            token_kernels.ROWS, keep = chunk, token_kernels.ROWS
            try:
                logp, ent = token_logprobs(gpt, ids[:, :-1], pos, causal_mask(seq), ids[:, 1:], 0.7,
                                           entropy="trained")
            finally:
                token_kernels.ROWS = keep
            (logp.sum() + 0.1 * ent.sum()).backward()
            grads = {n: p.grad.clone() for n, p in gpt.named_parameters() if p.grad is not None}
            out.append((logp.detach(), ent.detach(), grads))
        (la, ea, ga), (lb, eb, gb) = out
        return {"logp": float((la - lb).abs().max()), "entropy": float((ea - eb).abs().max()),
                "grad": max(float((ga[n] - gb[n]).abs().max()) for n in ga), "grads": len(ga),
                "same_grads": sorted(ga) == sorted(gb)}


class TPTrainer(Actor):
    """A tiny GRPO trainer shard (TP = world size) for tests."""

    @endpoint
    def setup_model(self, path: str, tp: int) -> None:
        import torch
        import torch.distributed as dist
        from safetensors.torch import load_file

        from engines.models.model import ModelConfig
        from engines.trainer import cpu_shim
        from engines.trainer.megatron_model import build_gpt, hf_to_megatron, shard_for_rank

        cpu_shim.install()
        dist.init_process_group("gloo", init_method="env://")
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        model_parallel_cuda_manual_seed(1234)
        self.cfg = ModelConfig.from_dir(path)
        self.model = build_gpt(self.cfg, tp=tp)
        full = hf_to_megatron(self.cfg, load_file(os.path.join(path, "model.safetensors")))
        missing, unexpected = self.model.load_state_dict(
            shard_for_rank(full, tp, parallel_state.get_tensor_model_parallel_rank()), strict=False
        )
        assert not [m for m in missing if not m.endswith("_extra_state")] and not unexpected
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-2)

    def _batch(self, seqs):
        import torch

        from engines.trainer.megatron_model import causal_mask

        ids = torch.tensor(seqs)
        b, s = ids.shape
        return ids[:, :-1], torch.arange(s - 1)[None].expand(b, -1), causal_mask(s - 1), ids[:, 1:]

    @endpoint
    def logprobs(self, seqs: list) -> list:
        import torch

        from engines.trainer.megatron_model import token_logprobs

        ids, pos, mask, tgt = self._batch(seqs)
        self.model.eval()
        with torch.no_grad():
            return token_logprobs(self.model, ids, pos, mask, tgt).tolist()

    @endpoint
    def grpo_step(self, seqs: list, advantages: list) -> dict:
        import torch

        from engines.trainer.loss import LossConfig, policy_loss
        from engines.trainer.megatron_model import token_logprobs

        ids, pos, mask, tgt = self._batch(seqs)
        self.model.train()
        with torch.no_grad():
            old = token_logprobs(self.model, ids, pos, mask, tgt)
        logp = token_logprobs(self.model, ids, pos, mask, tgt)
        loss, stats = policy_loss(logp, old, torch.tensor(advantages), torch.ones_like(logp) / logp.numel(),
                                   LossConfig())
        self.opt.zero_grad()
        loss.backward()  # replicated params (norms) get identical grads on every TP rank
        self.opt.step()
        return stats

    @endpoint
    def shutdown(self) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state

        dist.barrier()
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


class GradTrainer(TrainerActor):
    """A TrainerActor that also returns its gradients (after a step with the torch optimizer:
    DP-averaged, unclipped with clip_grad=0) under the full model's Megatron names, experts by
    global index (gathered over the expert-parallel group: every rank must call)."""

    @endpoint
    def full_grads(self) -> dict:
        from engines.trainer.moe_convert import gather_experts

        grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}
        return {n: g.cpu() for n, g in gather_experts(grads, self.cfg.num_experts, self.ep_group).items()}

    @endpoint
    def param_dtypes(self) -> dict[str, str]:
        """Each parameter's dtype, by Megatron name."""
        return {n: str(p.dtype).removeprefix("torch.") for n, p in self.model.named_parameters()}

    @endpoint
    def local_weights(self, contains: str) -> dict:
        """This rank's own parameters whose names contain ``contains`` (replicas: compare ranks)."""
        return {n: p.detach().cpu().clone() for n, p in self.model.named_parameters() if contains in n}


class GradProbe(TrainerActor):
    """A GRPO trainer shard whose gradients the test reads after a step (torch AdamW path, no
    clipping: ``p.grad`` then holds the DP-averaged gradient)."""

    @endpoint
    def set_micro_batch_tokens(self, tokens: int) -> None:
        self.micro_batch_tokens = tokens

    @endpoint
    def hf_grads(self) -> dict:
        """The last step's gradient under HF names (TP = 1), float64 CPU tensors."""
        from engines.trainer.megatron_model import megatron_to_hf

        grads = {n: p.grad.detach().double().cpu() for n, p in self.model.named_parameters() if p.grad is not None}
        return megatron_to_hf(self.cfg, grads)


class _Named:
    """Tensors by name, as ``gather_full`` reads a model (``named_parameters``, ``state_dict``)."""

    def __init__(self, tensors: dict):
        self.tensors = tensors

    def state_dict(self):
        return self.tensors

    def named_parameters(self):
        return list(self.tensors.items())


class StateProbe(TrainerActor):
    """A TrainerActor that returns its whole training state gathered to TP = EP = 1 (DP shards of
    the distributed optimizer gathered too), independently of the checkpoint code: every rank must
    call (collectives over TP, DP and EP)."""

    def _local_moments(self) -> dict:
        """Megatron name -> {exp_avg, exp_avg_sq} of this rank's (TP, EP) shard of each parameter."""
        import torch

        from engines.trainer import cpu_shim

        names = {p: n for n, p in self.model.named_parameters()}
        if self.opt.kind == "torch":
            return {names[p]: {k: self.opt.opt.state[p][k].detach().clone() for k in ("exp_avg", "exp_avg_sq")}
                    for p in self.model.parameters()}
        out = {}
        with cpu_shim.megatron_cuda_calls():
            for part in self.opt._parts:
                dp_zero = part.get_parameter_state_dp_zero(return_on_all_ranks=True)
                for i, buffer in enumerate(part.buffers):
                    world = next(iter(dp_zero[i].values()))
                    for p, (start, end, _) in buffer.param_index_map.items():
                        out[names[p]] = {k: world[k][start:end].view(p.shape).to(torch.float32).clone()
                                         for k in ("exp_avg", "exp_avg_sq", "param")}
        return out

    @endpoint
    def full_state(self) -> dict:
        """{"weights", "exp_avg", "exp_avg_sq"} (and "param", the distributed optimizer's fp32
        master weights): full Megatron-named tensors (experts by global index); "step": the trainer's step."""
        from engines.trainer.megatron_model import gather_full

        local = self._local_moments()
        group = self.tp_group if self.tp > 1 else None
        args = (True, self.ep_group, self.cfg.num_experts, self.cfg)
        out = {"weights": {n: t.float().cpu() for n, t in gather_full(self.model, group, *args).items()}}
        for k in ("exp_avg", "exp_avg_sq", "param"):  # param: the distributed optimizer's fp32 master weights
            if all(k in m for m in local.values()):
                out[k] = {n: t.cpu() for n, t in gather_full(_Named({n: m[k] for n, m in local.items()}), group,
                                                             *args).items()}
        out["step"] = self.step
        return out

    @endpoint
    def write_format1(self, path: str) -> None:
        """This rank's checkpoint file in format 1, as relay wrote it before dist_checkpointing
        (``torch.save`` of weights, optimizer state, step and RNG; torch optimizer, DP 1)."""
        import random

        import torch

        assert self.opt.kind == "torch" and self.dp_size == 1
        os.makedirs(path, exist_ok=True)
        name = f"trainer-tp{self.tp_rank}.pt" if self.ep == 1 else f"trainer-tp{self.tp_rank}-ep{self.ep_rank}.pt"
        torch.save({
            "model": {k: v for k, v in self.model.state_dict().items() if not k.endswith("_extra_state")},
            "opt": self.opt.opt.state_dict(),
            "optimizer": self.opt.kind,
            "step": self.step,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        }, os.path.join(path, name))
