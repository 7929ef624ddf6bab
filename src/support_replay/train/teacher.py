"""The distillation teacher in process: loaded beside the actor, never trained, checked against the student's
tokenizer and vocabulary at start-up, and scored on the planned micro-batches: the full-vocabulary log-softmax
(temperature 1) read at every support id of every token, and at the sampled token."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer

from ..errors import ConfigError
from .actor import ScoringModel, load_scoring_model
from .batches import MicroBatch


def check_head(where: str, teacher_vocab, student_vocab: int) -> None:
    """The teacher has a row for every id the student can sample: its head at least as wide as the student's. A wider
    one is the same tokenizer's embeddings padded further (models are padded to a multiple of 64 or 128): the
    tokenizers are compared apart, and no support id reaches the extra rows."""
    if not isinstance(teacher_vocab, int) or teacher_vocab < student_vocab:
        raise ConfigError(
            f"{where}: vocabulary of {teacher_vocab} ids, the student's has {student_vocab}: the student's ids from "
            f"{teacher_vocab} on have no row in the teacher"
        )


def check_teacher_matches(student_path, teacher_path) -> None:
    """The teacher scores the student's token ids: the same token map and chat template, and a head at least as
    wide, or ``ConfigError`` naming ``--opd-teacher-load`` and what differs."""
    if not Path(teacher_path).is_dir():
        raise ConfigError(f"--opd-teacher-load={str(teacher_path)!r}: not a checkpoint directory")
    widths = [AutoConfig.from_pretrained(p).vocab_size for p in (student_path, teacher_path)]
    check_head(f"--opd-teacher-load={str(teacher_path)!r}", widths[1], widths[0])
    student, teacher = (AutoTokenizer.from_pretrained(p) for p in (student_path, teacher_path))
    if student.get_vocab() != teacher.get_vocab():
        moved = sorted(set(student.get_vocab().items()) ^ set(teacher.get_vocab().items()))[:3]
        raise ConfigError(
            f"--opd-teacher-load={str(teacher_path)!r}: its tokenizer maps tokens to other ids than the student's "
            f"(first differences: {moved})"
        )
    if student.chat_template != teacher.chat_template:
        raise ConfigError(
            f"--opd-teacher-load={str(teacher_path)!r}: its chat template differs from the student's (the prompts "
            "the student saw would not be the teacher's)"
        )


@dataclass
class TeacherScores:
    """Per sample, flat: the teacher's log p_T at each support id (the support table's order) and at each
    sampled token."""

    support: list[torch.Tensor]
    selected: list[torch.Tensor]

    def rows(self, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``([N, K] at the micro-batch's padded support, 0 at padding; [N] at the sampled tokens)``."""
        ids, valid = batch.support
        rows = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
        rows[valid] = torch.cat([self.support[i] for i in batch.indices]).to(ids.device)
        return rows, torch.cat([self.selected[i] for i in batch.indices]).to(ids.device)


class Teacher:
    """``Teacher(path, ...)(batch) -> (support rows [N, K], selected [N])``, every value the teacher's
    full-vocabulary log-softmax at temperature 1: the distribution it is, not the student's sampling."""

    def __init__(self, model: ScoringModel):
        self.model = model

    @classmethod
    def load(cls, student_path, teacher_path, device, compute_dtype, linear_kernel, attn_implementation) -> Teacher:
        check_teacher_matches(student_path, teacher_path)
        model = load_scoring_model(
            teacher_path,
            device,
            compute_dtype=compute_dtype,
            linear_kernel=linear_kernel,
            attn_implementation=attn_implementation,
        )
        return cls(model.eval().requires_grad_(False))

    def rows(self, h, targets, support, transform):
        """Inside the teacher's forward (``ScoringModel.forward`` calls its scorer's ``rows``); penalties are
        the student's sampling, not the teacher's distribution: ``transform`` is not applied."""
        logits = self.model.hf.get_output_embeddings()(h).float()
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        ids, valid = support
        at_support = (logits.gather(1, ids) - lse).masked_fill(~valid, float("nan"))
        selected = (logits.gather(1, targets[:, None]) - lse).squeeze(1)
        return selected, None, None, at_support

    @torch.no_grad()
    def score(self, batch: MicroBatch, samples=None) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Sample index -> (its support values flat, its sampled tokens' values) for ``batch``."""
        selected, _, _, rows = self.model(batch, self)
        valid = batch.support[1]
        per_sample = zip(batch.split(rows), batch.split(valid), batch.split(selected))
        return {i: (r[v].cpu(), s.cpu()) for i, (r, v, s) in zip(batch.indices, per_sample)}
