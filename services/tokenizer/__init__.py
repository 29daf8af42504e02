"""The tokenizer service: prompt encoding (chat templates in a sandbox) and batched, incremental
detokenization with stop strings. `server.main` is `sluice serve tokenizer`."""
