"""The engine: requests in, token outputs out, one step at a time.

    llm_engine.py      LLMEngine (add / abort / step / stats / shutdown)
    llm.py             LLM, the offline generate / chat
    inputs.py          check_request and EngineInputError (torch-free)
    sampling_params.py SamplingParams (torch-free); sampler.py the row-wise sampler; outputs.py RequestOutput
"""
