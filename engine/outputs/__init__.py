"""What a step hands back: the requests' book (requests), the StepRecord and its events (records),
chat prompts (prompts) and incremental detokenizing (requests)."""
