"""`Glm5NextTextForCausalLM`: transformers' GLM-5.3-Flash text model with its LM head, for flat text-only
(`glm5_next_text`) checkpoints.

transformers 5.24 builds GLM-5.3-Flash only as `Glm5NextForConditionalGeneration` (text model under
`model.language_model.`, vision tower under `model.visual.`); it has no causal-LM class for the text config alone,
so neither AutoModelForCausalLM nor save_pretrained can serve a flat checkpoint (`model.layers.*`, `lm_head.weight`).
This class is that missing head, made of transformers' own `Glm5NextTextModel` (its KDA / DSA layers, recurrent
and indexer caches, and the checkpoint conversion table registered for glm5_next_text), with the forward of
`Glm5NextForConditionalGeneration` minus the vision inputs. Remove it when transformers ships one.
"""

from __future__ import annotations

from transformers import GenerationMixin, Glm5NextTextConfig
from transformers.modeling_outputs import MoeCausalLMOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextPreTrainedModel, Glm5NextTextModel


class Glm5NextTextForCausalLM(Glm5NextPreTrainedModel, GenerationMixin):
    config_class = Glm5NextTextConfig
    config: Glm5NextTextConfig
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: Glm5NextTextConfig) -> None:
        import torch

        super().__init__(config)
        self.model = Glm5NextTextModel(config)
        self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, logits_to_keep=0, past_key_values=None,
                **kwargs) -> MoeCausalLMOutputWithPast:
        cache = cache if cache is not None else past_key_values  # generate() may still pass the old name
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                         inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        logits = self.lm_head(slice_logits_to_keep(out.last_hidden_state, logits_to_keep))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return MoeCausalLMOutputWithPast(loss=loss, logits=logits, cache=out.cache)
