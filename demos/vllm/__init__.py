"""batchscope beside vLLM: starting a vLLM server (server), its row beside ours (side), both under
guidellm in turns (peers), and what the recording scheduler costs vLLM (recorder_cost, recorder_tokens)."""
