"""The engine: scheduler, model runner, sampler, detokenizer and the loop that drives them a step at a time."""
