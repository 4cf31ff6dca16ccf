"""Where results go: the rich console, results.json (the contract) and Weights & Biases."""
