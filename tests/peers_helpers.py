"""A scripted "model" for the peers benchmark's tests (``test_peers``, ``test_resubmit``): what it
writes for each of two questions, as a next-token policy over the tiny tokenizer, and that policy as
a cache-free model for the llama-server stand-in."""

from __future__ import annotations

import re

import torch

START, END = "<|retrieve|>", "<|endofretrieve|>"
QUESTIONS = ["Which release fixed error E1234?", "What priority does data loss get?"]
SCRIPTS = {  # what the "model" writes, piece by piece; True: letter by letter (one token per letter)
    QUESTIONS[0]: [("Release", True), (f"{START}error E1234 fixed{END}", False), (" 4.2.1, approved by", False),
                   (f"{START}release 4.2.1 approved by{END}", False), (" Priya Raman.", False)],
    QUESTIONS[1]: [(f"{START}data loss priority{END}", False), (" P1.", False)],
}
ANSWERS = ["Release 4.2.1, approved by Priya Raman.", "P1."]
QUERIES = [["error E1234 fixed", "release 4.2.1 approved by"], ["data loss priority"]]
"""Each question's queries, in order."""


class Policy:
    """The next token as a function of the text so far: the question's script continued from what
    was written (evidence blocks left out); EOS at its end, and after an end marker no evidence
    followed (an engine that ignores the stop string stops there)."""

    def __init__(self, tok):
        self.tok, self.eos = tok, tok.eos_token_id

    def next_token(self, ids) -> int:
        text = self.tok.decode(list(ids), skip_special_tokens=False)
        question = next(q for q in SCRIPTS if q in text)
        written = text[text.rfind("<|im_start|>assistant\n") + len("<|im_start|>assistant\n"):]
        if END in written and written.rfind("</evidence>") < written.rfind(END):
            return self.eos
        written = re.sub(r"\n<evidence>\n.*?</evidence>\n", "", written, flags=re.S)
        pos = 0
        for piece, spelled in SCRIPTS[question]:
            if len(written) < pos + len(piece):
                off = len(written) - pos
                if written[pos:] != piece[:off]:
                    return self.eos
                rest = piece[off:]
                return self.tok.encode(rest[0] if spelled else rest, add_special_tokens=False)[0]
            if written[pos : pos + len(piece)] != piece:
                return self.eos
            pos += len(piece)
        return self.eos


class PolicyModel:
    """The policy as a cache-free model for the llama-server stand-in."""

    def __init__(self, policy, vocab_size):
        self.policy, self.vocab_size = policy, vocab_size

    def __call__(self, input_ids):
        logits = torch.full((1, input_ids.shape[1], self.vocab_size), -30.0)
        logits[0, -1, self.policy.next_token(input_ids[0].tolist())] = 0.0
        return type("Out", (), {"logits": logits})()
