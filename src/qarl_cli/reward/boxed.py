"""Finding the final \\boxed{...} answer in a completion or a reference solution (pure string code)."""

import re
from typing import Optional

# An opening \boxed{ or \fbox{ (MATH solutions use both), escaped braces \{ \} (skipped: LaTeX set braces and
# \left\{ ... \right. need not pair up), and plain braces.
_TOKENS = re.compile(r"\\(?:boxed|fbox)\s*\{|\\[{}]|[{}]")


def last_boxed(text: str) -> Optional[str]:
    """Content of the \\boxed{...} that closes last, braces balanced; None if there is none.

    One pass with a stack, so unbalanced or adversarial input costs O(len(text)). For nested boxes the outer
    one closes last and wins; an unclosed box at a truncated end is ignored in favour of an earlier closed one."""
    stack: list[tuple[bool, int]] = []  # (opened by \boxed, position after the brace)
    found = None
    for m in _TOKENS.finditer(text):
        tok = m.group()
        if tok[0] == "\\" and len(tok) == 2:
            continue
        if tok == "}":
            if stack:
                boxed, start = stack.pop()
                if boxed:
                    found = (start, m.start())
        else:
            stack.append((tok != "{", m.end()))
    return None if found is None else text[found[0]:found[1]]


def has_boxed(text: str) -> bool:
    """Whether text contains a closed \\boxed{...}: the format the prompts ask for."""
    return last_boxed(text) is not None
