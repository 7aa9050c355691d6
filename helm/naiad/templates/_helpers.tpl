{{/* Chart name, truncated to fit label values. */}}
{{- define "naiad.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name: the release name, plus the chart name unless the release name already contains it. */}}
{{- define "naiad.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "naiad.selectorLabels" -}}
app.kubernetes.io/name: {{ include "naiad.name" . }}-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "naiad.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "naiad.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: naiad
{{- end -}}

{{- define "naiad.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "naiad.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "naiad.operatorImage" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "naiad.serverImage" -}}
{{- printf "%s:%s" .Values.serverImage.repository (default .Chart.AppVersion .Values.serverImage.tag) -}}
{{- end -}}

{{- define "naiad.llmServerImage" -}}
{{- printf "%s:%s" .Values.llmServerImage.repository (default (printf "%s-llm" .Chart.AppVersion) .Values.llmServerImage.tag) -}}
{{- end -}}

{{- define "naiad.adapterRulesName" -}}
{{- default (printf "%s-prometheus-adapter-rules" (include "naiad.fullname" .)) .Values.prometheusAdapter.rules.configMapName -}}
{{- end -}}

{{/* The operator's permissions, shared by the ClusterRole and the per-namespace Roles. */}}
{{- define "naiad.operatorRules" -}}
- apiGroups: [naiad.dev]
  resources: [inferenceservers, inferencemodels]
  verbs: [get, list, watch, create, update, patch, delete]
- apiGroups: [naiad.dev]
  resources: [inferenceservers/status, inferencemodels/status]
  verbs: [get, update, patch]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, update, patch, delete]
- apiGroups: [apps]
  resources: [replicasets]
  verbs: [get, list, watch]
- apiGroups: [""]
  resources: [services, persistentvolumeclaims]
  verbs: [get, list, watch, create, update, patch, delete]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, patch]
- apiGroups: [""]
  resources: [pods/status]
  verbs: [patch]
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [get, list, watch, create, update, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, update, patch, delete]
- apiGroups: [monitoring.coreos.com]
  resources: [servicemonitors]
  verbs: [get, list, watch, create, update, patch, delete]
# An InferencePool per LLM InferenceModel (Gateway API Inference Extension), when the cluster serves the API.
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, list, watch, create, update, patch, delete]
# A LeaderWorkerSet per LLM InferenceModel larger than a node (llm.gpusPerNode), when the cluster serves the API.
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets]
  verbs: [get, list, watch, create, update, patch, delete]
# An HTTPScaledObject per InferenceServer with minReplicas 0 (KEDA's HTTP add-on wakes it), when the API is served.
- apiGroups: [http.keda.sh]
  resources: [httpscaledobjects]
  verbs: [get, list, watch, create, update, patch, delete]
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create, patch]
# Each pool's copy of the control credential (<server>-control), and reading a pool's spec.tls Secret (ca.crt).
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create, update, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, update, patch, delete]
# Route first, unload after: a copy leaving a pod is unloaded once its model's EndpointSlices drop the pod.
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, watch]
{{- end -}}
