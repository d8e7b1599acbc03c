"""What a dump says about itself: the format tag and the layer convention, shared by the
plugin that writes dumps and the cluster code that plans and checks them."""

DUMP_FORMAT = "hidden-capture-dump"
DUMP_FORMAT_VERSION = 1
LAYER_CONVENTION = (
    "aux slot j is the residual stream entering decoder layer layer_ids[j], "
    "i.e. HF transformers output_hidden_states[layer_ids[j]]"
)
