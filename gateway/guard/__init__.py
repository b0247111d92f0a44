"""The token guard: does a new prompt extend what the decode node holds, and the tokenizer it renders prompts with."""
