"""Length-extrapolation evaluation: loss and perplexity of a model against context length."""
