"""Rewrite passes: pure functions (GraphModule, Plan, ...) -> GraphModule."""
