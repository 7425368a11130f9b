{{- define "meshwarp.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "meshwarp.fullname" -}}
{{- if contains (include "meshwarp.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "meshwarp.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "meshwarp.labels" -}}
app.kubernetes.io/name: {{ include "meshwarp.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "meshwarp.selectorLabels" -}}
app.kubernetes.io/name: {{ include "meshwarp.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}
{{- define "meshwarp.args" -}}
- run
{{- if .Values.cgroupPath }}
- --cgroup=/host{{ .Values.cgroupPath }}
{{- else }}
- --kube-pods-cgroup-in=/host/sys/fs/cgroup
{{- end }}
- --pin-dir={{ .Values.pinDir }}
- --sidecar-uid={{ .Values.sidecarUID }}
- --capacity={{ .Values.capacity }}
- --unpaired-timeout={{ .Values.unpairedTimeout }}
- --observe={{ .Values.observe }}
- --accelerate={{ .Values.accelerate }}
{{- if (.Values.crossNode).enabled }}
- --cross-node
{{- with .Values.crossNode.uplinks }}
- --uplinks={{ join "," . }}
{{- end }}
{{- end }}
- --config=/etc/meshwarp/policy.yaml
- --metrics-addr=0.0.0.0:{{ .Values.metrics.port }}
{{- if .Values.keepDataPathOnUpdate }}
- --keep-on-exit-while-daemonset=$(POD_NAMESPACE)/{{ include "meshwarp.fullname" . }}
{{- end }}
{{- if .Values.debug }}
- --debug
{{- end }}
{{- end -}}
