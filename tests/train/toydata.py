"""Tiny in-memory datasets with the astrai.data batch layout, for trainer tests (no tokenizer)."""

from __future__ import annotations

import torch

IGNORE = -100


class ToySeqDataset:
    """Rows of a repeating pattern: learnable next-token prediction. Labels are already shifted;
    with ``prompt_len`` the first positions carry no loss (an SFT-style mask)."""

    def __init__(self, num_rows: int = 32, seq_len: int = 16, vocab: int = 32, prompt_len: int = 0, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.rows = []
        for _ in range(num_rows):
            start = int(torch.randint(0, vocab, (1,), generator=g))
            step = int(torch.randint(1, 4, (1,), generator=g))
            length = seq_len - int(torch.randint(0, 4, (1,), generator=g))  # ragged: exercises padding
            ids = [(start + step * i) % vocab for i in range(length + 1)]
            labels = ids[1:]
            labels = [IGNORE] * prompt_len + labels[prompt_len:]
            self.rows.append((ids[:-1], labels))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        return self.rows[i]

    def collate(self, samples):
        T = max(len(ids) for ids, _ in samples)
        B = len(samples)
        input_ids = torch.zeros(B, T, dtype=torch.long)
        labels = torch.full((B, T), IGNORE, dtype=torch.long)
        mask = torch.zeros(B, T, dtype=torch.long)
        for b, (ids, lab) in enumerate(samples):
            input_ids[b, : len(ids)] = torch.tensor(ids)
            labels[b, : len(lab)] = torch.tensor(lab)
            mask[b, : len(ids)] = 1
        pos = torch.arange(T).expand(B, T).clone()
        return {"input_ids": input_ids, "labels": labels, "attention_mask": mask, "position_ids": pos}


class ToyPairDataset:
    """Preference pairs: chosen continues a prompt with the 'even' token set, rejected with odd tokens.
    Separable, so a policy can learn to prefer chosen quickly."""

    def __init__(self, num_rows: int = 32, prompt_len: int = 4, resp_len: int = 4, vocab: int = 32, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.rows = []
        for _ in range(num_rows):
            prompt = torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
            chosen = (torch.randint(0, vocab // 2, (resp_len,), generator=g) * 2).tolist()
            rejected = (torch.randint(0, vocab // 2, (resp_len,), generator=g) * 2 + 1).tolist()
            self.rows.append((prompt, chosen, rejected))
        self.seq = ToySeqDataset(1)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        return self.rows[i]

    def _side(self, samples, which: int):
        rows = []
        for prompt, chosen, rejected in samples:
            full = prompt + (chosen if which == 0 else rejected)
            labels = [IGNORE] * (len(prompt) - 1) + full[len(prompt):]
            rows.append((full[:-1], labels))
        return self.seq.collate(rows)

    def collate(self, samples):
        out = {}
        for name, which in (("chosen", 0), ("rejected", 1)):
            for k, v in self._side(samples, which).items():
                out[f"{name}_{k}"] = v
        return out
