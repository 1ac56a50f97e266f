"""One-off investigations worth keeping: each served one question (its docstring says which)."""
