# GLM-4.5 355B-A32B: the same architecture and MODEL_ARGS as GLM-4.7 355B-A32B (upstream slime's
# run-glm4.7-355B-A32B.sh sources this name).
# shellcheck source=glm4.7-355B-A32B.sh
source "$(dirname "${BASH_SOURCE[0]}")/glm4.7-355B-A32B.sh"
