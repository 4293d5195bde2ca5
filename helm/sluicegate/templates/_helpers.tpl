{{- define "sluicegate.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "sluicegate.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "sluicegate.instanceLabels" -}}
app.kubernetes.io/name: {{ include "sluicegate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The router's pods; the bundled Redis has its own component so selectors never overlap. */}}
{{- define "sluicegate.selectorLabels" -}}
{{ include "sluicegate.instanceLabels" . }}
app.kubernetes.io/component: router
{{- end }}

{{- define "sluicegate.redisSelectorLabels" -}}
{{ include "sluicegate.instanceLabels" . }}
app.kubernetes.io/component: redis
{{- end }}

{{- define "sluicegate.commonLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "sluicegate.labels" -}}
{{ include "sluicegate.commonLabels" . }}
{{ include "sluicegate.selectorLabels" . }}
{{- end }}

{{- define "sluicegate.redisLabels" -}}
{{ include "sluicegate.commonLabels" . }}
{{ include "sluicegate.redisSelectorLabels" . }}
{{- end }}

{{- define "sluicegate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "sluicegate.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The router's config file: backends from values, a key's env variable named per backend. */}}
{{- define "sluicegate.config" -}}
{{- $backends := list }}
{{- range $i, $b := .Values.backends }}
{{- $c := omit $b "apiKeySecret" }}
{{- if $b.apiKeySecret }}
{{- $_ := set $c "api_key_env" (printf "BACKEND_API_KEY_%d" $i) }}
{{- end }}
{{- $backends = append $backends $c }}
{{- end }}
{{- $cfg := deepCopy .Values.config }}
{{- $_ := set $cfg "backends" $backends }}
{{- $sources := include "sluicegate.discoverySources" . | fromYamlArray }}
{{- if $sources }}
{{- $_ := set $cfg "discovery" $sources }}
{{- end }}
{{- with .Values.scaleFromZero }}
{{- if .enabled }}
{{- $names := list }}
{{- range .models }}
{{- $names = append $names .name }}
{{- end }}
{{- $_ := set $cfg "scale_from_zero" (dict "models" $names "hold_timeout_s" .holdTimeoutSeconds "max_held" .maxHeld "scaler_port" .scalerPort "target_per_replica" .targetPerReplica) }}
{{- end }}
{{- end }}
{{- with .Values.tracing }}
{{- if .otlpEndpoint }}
{{- $_ := set $cfg "tracing" (dict "otlp_endpoint" .otlpEndpoint "sample_ratio" .sampleRatio "service_name" .serviceName) }}
{{- end }}
{{- end }}
{{- toYaml $cfg }}
{{- end }}

{{- define "sluicegate.redisUrl" -}}
{{- if .Values.redis.enabled }}
{{- printf "redis://%s-redis:6379/0" (include "sluicegate.fullname" .) }}
{{- else }}
{{- .Values.redis.url }}
{{- end }}
{{- end }}

{{- define "sluicegate.terminationGrace" -}}
{{- add (int .Values.preStopSleepSeconds) (int (ceil .Values.config.drain_grace)) 15 }}
{{- end }}

{{/* Namespaces whose EndpointSlices the router watches (one Role + RoleBinding in each). */}}
{{- define "sluicegate.discoveryNamespaces" -}}
{{- $namespaces := list }}
{{- range .Values.discovery }}
{{- if eq .kind "kubernetes" }}
{{- $namespaces = append $namespaces (default $.Release.Namespace .namespace) }}
{{- end }}
{{- end }}
{{- uniq $namespaces | join "," }}
{{- end }}

{{/* The config's discovery sources: the values' (kubernetes and inferencepool ones in the
release's namespace unless they name one), and, for the picker, its own pool's. */}}
{{- define "sluicegate.discoverySources" -}}
{{- $sources := list }}
{{- $mine := false }}
{{- $pool := include "sluicegate.poolName" . }}
{{- range .Values.discovery }}
{{- $s := deepCopy . }}
{{- if and (has .kind (list "kubernetes" "inferencepool")) (not .namespace) }}
{{- $_ := set $s "namespace" $.Release.Namespace }}
{{- end }}
{{- if and (eq .kind "inferencepool") (eq .name $pool) (eq $s.namespace $.Release.Namespace) }}
{{- $mine = true }}
{{- end }}
{{- $sources = append $sources $s }}
{{- end }}
{{- if and .Values.picker.enabled (not $mine) }}
{{- $sources = append $sources (dict "kind" "inferencepool" "name" $pool "namespace" .Release.Namespace) }}
{{- end }}
{{- toYaml $sources }}
{{- end }}

{{/* The InferencePool the picker serves: the one it creates, or an existing one by name. */}}
{{- define "sluicegate.poolName" -}}
{{- default (include "sluicegate.fullname" .) .Values.picker.inferencePool.name }}
{{- end }}

{{/* Namespaces of the InferencePools the router follows (one Role + RoleBinding in each). */}}
{{- define "sluicegate.poolNamespaces" -}}
{{- $namespaces := list }}
{{- range (include "sluicegate.discoverySources" . | fromYamlArray) }}
{{- if eq .kind "inferencepool" }}
{{- $namespaces = append $namespaces .namespace }}
{{- end }}
{{- end }}
{{- uniq $namespaces | join "," }}
{{- end }}
