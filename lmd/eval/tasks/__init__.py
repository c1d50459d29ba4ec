"""Zero-shot accuracy by lm-evaluation-harness's rules (`lmd eval tasks`): task formats, a backend-independent
scorer, and the transformers / engine backends that compute the log-likelihoods."""
