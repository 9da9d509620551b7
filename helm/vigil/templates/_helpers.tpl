{{/* Names, labels and the image reference shared by every template. */}}

{{- define "vigil.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "vigil.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* A component's object name: <fullname>-<component>. Call with (list $ "collector"). */}}
{{- define "vigil.componentName" -}}
{{- $root := index . 0 -}}
{{- printf "%s-%s" (include "vigil.fullname" $root | trunc 50 | trimSuffix "-") (index . 1) -}}
{{- end -}}

{{- define "vigil.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels of a component. Call with (list $ "collector"). */}}
{{- define "vigil.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "vigil.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* All labels of a component's objects. Call with (list $ "collector"). */}}
{{- define "vigil.labels" -}}
{{- $root := index . 0 -}}
helm.sh/chart: {{ include "vigil.chart" $root }}
{{ include "vigil.selectorLabels" . }}
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
app.kubernetes.io/part-of: vigil
{{- with $root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "vigil.image" -}}
{{- $img := .Values.image -}}
{{- $ref := printf "%s/%s" $img.registry $img.repository | trimPrefix "/" -}}
{{- if $img.digest -}}
{{- printf "%s@%s" $ref $img.digest -}}
{{- else -}}
{{- printf "%s:%s" $ref (default .Chart.AppVersion $img.tag) -}}
{{- end -}}
{{- end -}}

{{- define "vigil.imagePullSecrets" -}}
{{- with .Values.image.pullSecrets }}
imagePullSecrets:
{{- range . }}
  - name: {{ . }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The ServiceAccount a component runs as. Call with (list $ "collector"). */}}
{{- define "vigil.serviceAccountName" -}}
{{- $root := index . 0 -}}
{{- $sa := (index $root.Values (index . 1)).serviceAccount -}}
{{- if $sa.create -}}
{{- default (include "vigil.componentName" .) $sa.name -}}
{{- else -}}
{{- default "default" $sa.name -}}
{{- end -}}
{{- end -}}

{{- define "vigil.tokenSecret" -}}
{{- default (printf "%s-tokens" (include "vigil.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{- define "vigil.collectorURL" -}}
{{- printf "http://%s.%s.svc:%d" (include "vigil.componentName" (list . "collector")) .Release.Namespace (int .Values.collector.port) -}}
{{- end -}}

{{/* Environment every component shares: logging. */}}
{{- define "vigil.commonEnv" -}}
- name: VIGIL_LOG_LEVEL
  value: {{ .Values.log.level | quote }}
- name: VIGIL_LOG_FORMAT
  value: {{ .Values.log.format | quote }}
{{- end -}}

{{/* The restricted container security context (the agent adds what stack dumps need). */}}
{{- define "vigil.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end -}}
