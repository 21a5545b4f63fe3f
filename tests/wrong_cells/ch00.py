"""Plausible wrong versions of chapter 00's exercises, for the notebook's own check cells."""

_NORM = "    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # [..., dim]\n"
_SCORES = '    scores = torch.einsum("thd,shd->hts", q, k) / D**0.5  # [Hq, T, S]\n'
_MASK = ('    scores = scores.masked_fill(future, float("-inf"))  # exp(-inf) = 0: no weight on '
         'the future\n')
_POS = ("        pos = torch.tensor([len(input_ids) + i - 1])  # [1]: its place in the whole "
        "sequence\n")
_CALL = ("        logits = forward(model, ids, pos, kv)  # [1, V]; every layer's kv grows by one "
         "row\n")

CASES = [
    # (exercise, module path, what the learner got wrong, ((old, new), ...))
    ("0.1", "minisgl/step0/layers.py", "the weight is never applied: return x",
     (("    return weight * x\n", "    return x\n"),)),
    ("0.1", "minisgl/step0/layers.py", "eps added outside the square root",
     ((_NORM, "    x = x / (x.pow(2).mean(-1, keepdim=True).sqrt() + eps)\n"),)),
    ("0.1", "minisgl/step0/layers.py", "sum of squares instead of their mean",
     ((_NORM, _NORM.replace(".mean(", ".sum(")),)),
    ("0.1", "minisgl/step0/layers.py", "mean without keepdim: shapes do not broadcast",
     ((_NORM, _NORM.replace(".mean(-1, keepdim=True)", ".mean(-1)")),)),
    ("0.2", "minisgl/step0/layers.py", "no 1/sqrt(D) scale on the scores",
     ((_SCORES, _SCORES.replace(" / D**0.5", "")),)),
    ("0.2", "minisgl/step0/layers.py", "scores divided by D instead of sqrt(D)",
     ((_SCORES, _SCORES.replace(" / D**0.5", " / D")),)),
    ("0.2", "minisgl/step0/layers.py", "softmax over the queries (dim=-2) instead of the keys",
     (("torch.softmax(scores.float(), dim=-1)", "torch.softmax(scores.float(), dim=-2)"),)),
    ("0.2", "minisgl/step0/layers.py", "no causal mask", ((_MASK, ""),)),
    ("0.2", "minisgl/step0/layers.py", "top-left causal mask (diagonal=1) ignores the cached keys",
     (("diagonal=S - T + 1)", "diagonal=1)"),)),
    ("0.3", "minisgl/step0/generation.py", "decode position off by one: len(input_ids) + i",
     ((_POS, _POS.replace("len(input_ids) + i - 1", "len(input_ids) + i")),)),
    ("0.3", "minisgl/step0/generation.py", "position counted from the first new token: i",
     ((_POS, _POS.replace("len(input_ids) + i - 1", "i")),)),
    ("0.3", "minisgl/step0/generation.py", "a fresh cache every step: forward(..., [])",
     ((_CALL, _CALL.replace("pos, kv)", "pos, [])")),)),
    ("0.3", "minisgl/step0/generation.py", "loop from 0: one token too many",
     (("    for i in range(1, max_new_tokens):\n", "    for i in range(max_new_tokens):\n"),)),
    ("0.3", "minisgl/step0/generation.py", "on_step is never called for the decode steps",
     (("            on_step(i, time.perf_counter() - start)\n", "            pass\n"),)),
]

_CAT_K = "        kv[i][0] = torch.cat([kv[i][0], k])  # [S, Hkv, D]\n"
_CAT_V = "        kv[i][1] = torch.cat([kv[i][1], v])  # [S, Hkv, D]\n"
CASES += [
    ("0.4", "minisgl/step0/generation.py", "the cache is replaced by the new rows, not grown",
     ((_CAT_K, "        kv[i][0] = k\n"), (_CAT_V, "        kv[i][1] = v\n"))),
    ("0.4", "minisgl/step0/generation.py", "new rows first: torch.cat([k, kv[i][0]])",
     ((_CAT_K, _CAT_K.replace("[kv[i][0], k]", "[k, kv[i][0]]")),
      (_CAT_V, _CAT_V.replace("[kv[i][1], v]", "[v, kv[i][1]]")))),
    ("0.4", "minisgl/step0/generation.py",
     "the first call stores the rows, then appends them again",
     (("            kv.append([k[:0], v[:0]])\n", "            kv.append([k, v])\n"),)),
]
