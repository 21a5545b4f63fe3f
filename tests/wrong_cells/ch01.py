"""Plausible wrong versions of chapter 01's exercises, for the notebook's own check cells."""

_LENGTHS = ("        self.device_len = len(ids)\n"
            "        self.max_device_len = len(ids) + self.output_len\n")
_COMPLETE = "        self.cached_len = self.device_len\n        self.device_len += 1\n"
_FORWARD_BATCH = ("        self._batch = batch\n"
                  "        try:\n"
                  "            yield\n"
                  "        finally:\n"
                  "            self._batch = None\n")
_NESTING = ("        if self._batch is not None:\n"
            "            raise RuntimeError(\"nested forward_batch: a batch is already active; one "
            "forward \"\n"
            "                               \"at a time (finish the current `with "
            "ctx.forward_batch(...)`).\")\n")
_REPLICATE = ("        if b % a != 0:\n"
              "            raise ValueError(f\"cannot replicate {a} items over {b} ranks: {b} is "
              "not a multiple \"\n"
              "                             f\"of {a}.\")\n")
_EVEN = ("    if a % b != 0:\n"
         "        raise ValueError(f\"{a} is not divisible by {b}: cannot split {a} items evenly "
         "over \"\n"
         "                         f\"{b} ranks.\")\n")

CASES = [
    # (exercise, module path, what the learner got wrong, ((old, new), ...))
    ("1.1", "minisgl/req.py", "max_device_len forgets the prompt: output_len alone",
     ((_LENGTHS, _LENGTHS.replace("len(ids) + self.output_len", "self.output_len")),)),
    ("1.1", "minisgl/req.py", "device_len leaves out the cached prefix: len(ids) - cached_len",
     ((_LENGTHS, _LENGTHS.replace("self.device_len = len(ids)",
                                  "self.device_len = len(ids) - self.cached_len")),)),
    ("1.1", "minisgl/req.py", "max_device_len one short: len(ids) + output_len - 1",
     ((_LENGTHS, _LENGTHS.replace("+ self.output_len", "+ self.output_len - 1")),)),
    ("1.2", "minisgl/req.py", "extend_len forgets the cached tokens: device_len",
     (("        return self.device_len - self.cached_len\n",
       "        return self.device_len\n"),)),
    ("1.2", "minisgl/req.py", "extend_len counts up to the limit: max_device_len - cached_len",
     (("        return self.device_len - self.cached_len\n",
       "        return self.max_device_len - self.cached_len\n"),)),
    ("1.3", "minisgl/req.py", "lines swapped: device_len advanced before it is copied",
     ((_COMPLETE, "        self.device_len += 1\n        self.cached_len = self.device_len\n"),)),
    ("1.3", "minisgl/req.py", "device_len never advances",
     ((_COMPLETE, "        self.cached_len = self.device_len\n"),)),
    ("1.3", "minisgl/req.py", "cached_len += 1: right for a decode step, wrong after a prefill",
     ((_COMPLETE, "        self.cached_len += 1\n        self.device_len += 1\n"),)),
    ("1.4", "minisgl/core.py", "no try/finally: an exception in the body leaves the batch set",
     ((_FORWARD_BATCH,
       "        self._batch = batch\n        yield\n        self._batch = None\n"),)),
    ("1.4", "minisgl/core.py", "nesting is not refused", ((_NESTING, ""),)),
    ("1.4", "minisgl/core.py", "the batch is never installed",
     ((_FORWARD_BATCH, _FORWARD_BATCH.replace("        self._batch = batch\n", "")),)),
    ("1.5", "minisgl/utils/misc.py", "no divisibility check: a // b for any a, b",
     ((_EVEN, ""),)),
    ("1.5", "minisgl/utils/misc.py", "replicate without checking that b is a multiple of a",
     ((_REPLICATE, ""),)),
    ("1.5", "minisgl/utils/misc.py", "replicate returns the copies per item, b // a, not 1",
     (("        return 1\n", "        return b // a\n"),)),
]

CASES += [
    ("1.4", "minisgl/core.py", "nesting refused with an assert, as upstream, not a RuntimeError",
     ((_NESTING, "        assert self._batch is None, \"a batch is already active\"\n"),)),
    ("1.5", "minisgl/utils/misc.py", "the error does not name the numbers",
     ((_EVEN, "    if a % b != 0:\n"
              "        raise ValueError(\"cannot split the items evenly over the ranks.\")\n"),)),
]
