{{/* The release's full name, used for every object of the chart. */}}
{{- define "spotrl.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "spotrl.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "spotrl.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "spotrl.serviceAccountName" -}}
{{- default (include "spotrl.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "spotrl.image" -}}
{{- printf "%s:%s" .repository (default $.appVersion .tag) -}}
{{- end -}}

{{/* cpu=500m,memory=4Gi from {cpu: 500m, memory: 4Gi}. */}}
{{- define "spotrl.requests" -}}
{{- $out := list -}}
{{- range $k, $v := . -}}
{{- $out = append $out (printf "%s=%v" $k $v) -}}
{{- end -}}
{{- join "," $out -}}
{{- end -}}

{{/* The image prefixes RLJobs may use, as a JSON list: imagePolicy.allowedImages, or the
runtime image's repository with any tag or digest. */}}
{{- define "spotrl.allowedImages" -}}
{{- if .Values.imagePolicy.allowedImages -}}
{{- .Values.imagePolicy.allowedImages | toJson -}}
{{- else -}}
{{- list (printf "%s:" .Values.runtimeImage.repository) (printf "%s@" .Values.runtimeImage.repository) | toJson -}}
{{- end -}}
{{- end -}}

{{/* The operator's ServiceAccount as the API server names the requests it sends, quoted for CEL. */}}
{{- define "spotrl.operatorUsername" -}}
{{ printf "system:serviceaccount:%s:%s" .Release.Namespace (include "spotrl.serviceAccountName" .) | squote }}
{{- end -}}
