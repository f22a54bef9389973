"""What SGLang's memory profile sees: per-feature KV cell sizes and device budgets."""
