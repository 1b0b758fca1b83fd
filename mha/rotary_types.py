"""The rotary model types mha has checked against transformers' own layers, each with the
convention its config does not tell, and those whose code turns queries and keys by a rule mha
has not checked. `mha.model_rope` reads the rest of a rotary embedding from the config.
"""

from __future__ import annotations

__all__ = ["ROTARY", "UNCHECKED_ROTARY"]

# The rotary convention of each model type checked against transformers' own layer, which
# its config does not tell: "half" rotates features (i, i + d/2) as Llama, "pairs"
# (2i, 2i + 1) as GPT-J, "rope_interleave" as the config's field of that name says (pairs when
# True, its default)
ROTARY = {
    "afmoe": "half",  # Arcee's Trinity
    "apertus": "half",
    "apertus1p5_text": "half",  # Apertus 1.5's text model is Apertus's
    "arcee": "half",
    "aria_text": "half",
    "axk1": "rope_interleave",  # DeepSeek-V3's latent attention
    "cohere": "pairs",
    "cohere2": "pairs",
    "cohere2_moe": "pairs",
    "cohere_compass_text": "half",  # Cohere's North (Compass) text model
    "csm": "half",
    "cwm": "half",
    "deepseek_v2": "pairs",
    "deepseek_v3": "rope_interleave",
    "dots1": "half",
    "ernie4_5": "pairs",
    "ernie4_5_moe": "pairs",
    "esm": "half",  # ESM-2's, where position_embedding_type is "rotary"
    "esmc": "half",
    "eurobert": "half",
    "exaone": "half",  # EXAONE 3 and 3.5, Llama's layers in transformers
    "exaone4": "half",
    "exaone_moe": "half",
    "falcon": "half",
    "falcon_h1": "half",
    "flex_olmo": "half",
    "flint": "half",
    "gemma": "half",
    "gemma2": "half",
    "gemma3_text": "half",
    "gemma3n_text": "half",
    "gemma4_text": "half",
    "embedding_gemma2_text": "half",
    "glm": "pairs",
    "glm4": "pairs",
    "glm4_moe": "half",
    "glm4_moe_lite": "rope_interleave",  # DeepSeek-V3's latent attention
    # GLM-4.1V's, GLM-4.5V's, GLM-OCR's and GLM-Image's text models: multimodal rotary, turning
    # a text as the plain one
    "glm4v_text": "pairs",
    "glm4v_moe_text": "half",
    "glm_image_text": "half",
    "glm_ocr_text": "pairs",
    "gpt_neox": "half",
    "gpt_oss": "half",
    "gptj": "pairs",
    "granite": "half",
    "granite_docling_text": "half",
    "granitemoe": "half",
    "granitemoehybrid": "half",  # Granite 4.0's, where position_embedding_type is "rope"
    "granitemoeshared": "half",
    "granite_swa": "half",
    "granitemoe_swa": "half",
    "gte": "half",
    "helium": "pairs",
    "higgs_audio_v2": "half",
    "hunyuan_v1_dense": "half",
    "hunyuan_v1_moe": "half",
    "hy_v3": "half",
    "hyperclovax": "half",
    "internlm3": "half",
    "iquestcoder": "half",  # transformers builds Llama's modules
    "jais2": "half",
    "jina_embeddings_v3": "half",
    "kolibri1": "half",
    "lara_mini": "half",
    "lfm2": "half",
    "lfm2_moe": "half",
    "lfm3": "half",
    # Kimi K2's own config.json: transformers reads it as DeepSeek-V3's (Kimi K2.5's text_config)
    "kimi_k2": "rope_interleave",
    "llama": "half",
    "llama4_text": "pairs",  # complex products of (2i, 2i + 1)
    "mellum": "half",
    "minicpm3": "half",  # DeepSeek-V2's latent attention, Llama's rotary
    "minicpm5_moe": "half",  # Llama's attention, each head's queries beside its gate
    "minimax": "half",  # MiniMax-Text-01's full-attention layers
    "minimax_m2": "half",
    "minimax_m3_vl_text": "half",  # MiniMax-M3's text model, its full-attention layers
    "ministral": "half",
    "ministral3": "half",
    "mistral": "half",
    "mistral4": "rope_interleave",  # DeepSeek-V3's latent attention
    "mixtral": "half",
    "modernbert": "half",  # an encoder: its windows reach sliding_window positions either side
    "modernbert-decoder": "half",
    "molmo2_text": "half",
    "muse_glimmer_text": "half",
    "nanochat": "half",  # turned the other way: the port's reversed_rotary
    "nemotron": "half",
    "nomic_bert": "half",
    "olmo": "half",
    "olmo2": "half",
    "olmo3": "half",
    "olmo_hybrid": "half",  # its full-attention layers; rope_parameters' rope_theta null: none
    "olmoe": "half",
    "openai_privacy_filter": "pairs",  # gpt-oss's attention both ways, its pairs interleaved
    "param2moe": "half",  # Param2, GLM-4.5's layers in transformers, the whole head rotated
    "phi": "half",
    "phi3": "half",
    "phimoe": "half",
    "qwen2": "half",
    "qwen2_moe": "half",
    "qwen2_5_vl_text": "half",  # multimodal rotary, turning text as the plain one
    "qwen2_vl_text": "half",
    "qwen3": "half",
    "qwen3_moe": "half",
    "qwen3_next": "half",
    # Qwen3.5's text models (Qwen3-Next's attention); their multimodal rotary turns text as this
    "qwen3_5_moe_text": "half",
    "qwen3_5_text": "half",
    "qwen3_vl_moe_text": "half",
    "qwen3_vl_text": "half",
    "recurrent_gemma": "half",  # its local-attention layers, beside its recurrent ones
    "roformer": "pairs",
    "sarvam_mla": "rope_interleave",  # DeepSeek-V3's layers in transformers
    "sarvam_moe": "half",  # GLM-4.5's layers in transformers, the whole head rotated
    "seed_oss": "half",
    "smollm3": "half",
    "solar_open": "half",
    "stablelm": "half",
    "ultrabert": "half",  # an encoder: its windows reach sliding_window positions either side
    "starcoder2": "half",
    "vaultgemma": "half",
    "youtu": "rope_interleave",  # DeepSeek-V3's latent attention
}

# Model types whose code in transformers turns queries and keys (their modeling modules call
# a rotary embedding) by a rule mha has not checked, or beside what mha's layer holds: text,
# vision and audio models alike. A config of one is refused even where it writes no rotary
# field (transformers rotates with its defaults); tests/test_config_defaults.py holds the list
# to the installed transformers' code
UNCHECKED_ROTARY = frozenset(
    (
        "apertus1p5_vision_tokenizer axk2 bailing_hybrid bamba beam bitnet "
        "blt_global_transformer blt_local_decoder blt_local_encoder blt_patcher "
        "chameleon_vqgan clvp_decoder clvp_encoder codegen "
        "cohere_compass_vision cosmos3_edge_text cosmos3_edge_vision csm_depth_decoder_model "
        "dbrx deepseek_ocr2_encoder deepseek_ocr2_sam_vision_model deepseek_ocr2_text "
        "deepseek_v32 deepseek_v4 dia_decoder dia_encoder diffllama diffusion_gemma_text "
        "dinov3_vit doge dory dots3_note_audio_encoder dots3_note_text "
        "dots3_note_vision_encoder edgetam_video_mask_decoder edgetam_video_prompt_encoder "
        "efficientloftr emu3_text_model emu3_vqgan eomt_dinov3 ergo "
        "ernie4_5_vl_moe_text ernie4_5_vl_moe_vision exaone4_5_vision gemma3n_audio "
        "gemma3n_vision gemma4_audio gemma4_unified_audio gemma4_unified_text "
        "gemma4_unified_vision gemma4_vision glm4v_moe_vision "
        "glm4v_vision glm5_next_text glm5_next_vision glm_image_vision "
        "glm_image_vqmodel glm_moe_dsa glm_ocr_vision glmasr_encoder "
        "gpt_neox_japanese granite4_vision_text granite_docling_vision hrm_text "
        "hunyuan_vl_text hunyuan_vl_vision hy_v4 hy_v4_vl_text hy_v4_vl_vision "
        "idefics_perciever idefics_vision inkling2_text inkling2_vision jetmoe "
        "kimi_k25_vision kolibri1_1 laguna lasr_encoder lfm3_vl_vision llama4_vision_model "
        "llava_onevision1_5_vision longcat_flash "
        "mimi mimi_decoder mimi_encoder mimo_v2_flash minimax_m3_vl_vision "
        "mistral_large4_text mlcd mlcd_vision_model mllama_text_model mllama_vision_model "
        "molmo2_adapter molmo2_vision moonshine "
        "moonshine_streaming_encoder moshi_depth muse_glimmer_assistant "
        "muse_glimmer_vision muse_spark_audio muse_spark_text muse_spark_vision "
        "nemotron3_5_transcribe_asr_audio nemotron3_5_transcribe_word_timestamp "
        "nemotron3_diarization_audio neomme ovis2_5_vision paddleocr_vl_text "
        "paddleocr_vl_vision persimmon phi4_multimodal_audio phi4_multimodal_vision pixtral "
        "pocket_tts_audio_tokenizer pocket_tts_audio_tokenizer_decoder "
        "pocket_tts_audio_tokenizer_encoder qwen2_5_omni_audio_encoder qwen2_5_omni_bigvgan "
        "qwen2_5_omni_dit qwen2_5_omni_talker qwen2_5_omni_text qwen2_5_omni_vision_encoder "
        "qwen2_5_vl_vision qwen2_vl_vision qwen3_5_moe_vision qwen3_5_vision "
        "qwen3_omni_moe_audio_encoder qwen3_omni_moe_talker_code_predictor "
        "qwen3_omni_moe_talker_text qwen3_omni_moe_text qwen3_omni_moe_vision_encoder "
        "qwen3_vl_moe_vision qwen3_vl_vision qwen4_exp_text qwen4_exp_vision "
        "sam2_video_mask_decoder sam2_video_prompt_encoder sam3_detr_decoder "
        "sam3_detr_encoder sam3_geometry_encoder sam3_mask_decoder "
        "sam3_tracker_video_mask_decoder sam3_tracker_video_prompt_encoder sam3_vit_model "
        "sapiens2_head seamless_m4t step3p5 step3p5_vision t5_gemma_module t5gemma2_decoder "
        "t5gemma2_text "
        "timesfm2_5 unlimited_ocr_sam_vision_model unlimited_ocr_text "
        "unlimited_ocr_vision_encoder video_llama_3_vision vjepa2 voxtral_realtime_encoder "
        "voxtral_realtime_text wav2vec2-bert wav2vec2-conformer zamba2 zaya"
    ).split()
)
