"""What scripts/crosscheck-llamacpp.sh and scripts/crosscheck-vllm.sh print: per prompt,
whether kvfence's tokens and the other engine's are identical and, at the first divergence,
both tokens and the top-two logit margins there; then a summary line. Each script imports
it from this folder (its path is the script's first argument)."""


class Report:
    def __init__(self, engine):
        self.engine, self.same, self.total, self.notes = engine, 0, 0, []

    def compare(self, k, theirs, their_text, their_margins=None):
        """`k` is one line of kvfence's output (name, tokens, text, margins); `theirs` the
        other engine's tokens for the same prompt, stop tokens left out."""
        self.total += 1
        ours = k["tokens"]
        if ours == theirs:
            self.same += 1
            print(f"{k['name']:>10}: identical ({len(ours)} tokens): {k['text']!r}")
            return
        i = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                 min(len(ours), len(theirs)))
        a = ours[i] if i < len(ours) else "stop"
        b = theirs[i] if i < len(theirs) else "stop"
        note = f"{k['name']} at step {i}: kvfence {a} (margin {k['margins'][i]:.3f}), {self.engine} {b}"
        if their_margins is not None and i < len(their_margins):
            note += f" (margin {their_margins[i]:.3f})"
        self.notes.append(note)
        width = max(len("kvfence"), len(self.engine)) + 2
        print(f"{k['name']:>10}: DIVERGES {note}")
        print(f"{'':>12}{'kvfence:':<{width}}{k['text']!r}")
        print(f"{'':>12}{self.engine + ':':<{width}}{their_text!r}")

    def summary(self):
        print(f"crosscheck: {self.same}/{self.total} prompts identical"
              + (f"; divergences: {'; '.join(self.notes)}" if self.notes else ""))
